"""llama_api_check has two implementations under one name, side by side in plugins/modules: the .py for a POSIX host
and the .ps1 for a Windows host (one contract, the same result fields).

A PowerShell connection asks Ansible for ``.ps1`` first and gets the Windows module. A POSIX connection asks for a
module of any extension, and Ansible takes the first file in sort order, which would be the .ps1; so this action asks
for the ``.py`` by name there. Everything else is Ansible's own module action (check mode, async, the result).
"""

from __future__ import annotations

from ansible.plugins.action.normal import ActionModule as ModuleAction


class ActionModule(ModuleAction):
    def _configure_module(self, module_name, module_args, task_vars):
        connection = self._connection
        preferences = connection.module_implementation_preferences
        if ".ps1" in preferences:
            return super()._configure_module(module_name, module_args, task_vars)
        connection.module_implementation_preferences = (".py",)
        try:
            return super()._configure_module(module_name, module_args, task_vars)
        finally:
            connection.module_implementation_preferences = preferences
