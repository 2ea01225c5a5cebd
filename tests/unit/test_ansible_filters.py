import shlex

import jinja2

from controller.ansible_filters import filters, systemd_command


def test_systemd_command_escapes_specifiers_variables_and_quotes():
    words = ["/opt/llama/cpu/current/bin/llama-server", "--alias", 'say "hi" 100%', "$HOME", "a\\b"]
    line = systemd_command(words)
    assert '"100%%"' not in line and "100%%" in line and "$$HOME" in line
    # After systemd undoes %% and $$, the line splits back into the same words (systemd follows
    # shell-like double-quote rules for these characters).
    assert shlex.split(line.replace("%%", "%").replace("$$", "$")) == words


def test_filters_work_in_a_bare_jinja_environment():
    env = jinja2.Environment()
    env.filters.update(filters())
    assert env.from_string("{{ ['a b', 'c'] | systemd_command }}").render() == '"a b" "c"'
