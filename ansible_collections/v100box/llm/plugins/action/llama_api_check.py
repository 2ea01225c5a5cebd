"""llama_api_check has two implementations behind one task name: plugins/modules/llama_api_check.py for a POSIX host
and plugins/modules/win_llama_api_check.ps1 for a Windows host (one contract, the same result fields), so a role
checks a box with one task whatever its OS.

A POSIX host runs the module of the task's own name, the one file of that name: any strategy finds it, the mitogen
strategy too (it looks a module up by name alone, with no extension, and would take a .ps1 of the same name). A
PowerShell host runs the Windows module under its own name. Everything else is Ansible's own module action (check
mode, async, the result).
"""

from __future__ import annotations

from ansible.plugins.action.normal import ActionModule as ModuleAction

WINDOWS_MODULE = "v100box.llm.win_llama_api_check"


class ActionModule(ModuleAction):
    def _execute_module(self, module_name=None, *args, **kwargs):
        if module_name is None and self._connection._shell.SHELL_FAMILY == "powershell":
            module_name = WINDOWS_MODULE
        return super()._execute_module(module_name, *args, **kwargs)
