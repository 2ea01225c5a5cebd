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


def test_reachable_host_in_a_bare_jinja_environment():
    env = jinja2.Environment()
    env.filters.update(filters())
    url = env.from_string("http://{{ bind | reachable_host }}:{{ port }}/health")
    assert url.render(bind="0.0.0.0", port=8011) == "http://127.0.0.1:8011/health"
    assert url.render(bind="::", port=8011) == "http://[::1]:8011/health"
    assert url.render(bind="::1", port=1) == "http://[::1]:1/health"
    assert url.render(bind="192.168.1.5", port=1) == "http://192.168.1.5:1/health"
    assert url.render(bind="box.lan", port=1) == "http://box.lan:1/health"
