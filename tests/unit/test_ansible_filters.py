import shlex

import jinja2
import pytest

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


def test_gpu_minors_of_an_instance_in_a_bare_jinja_environment():
    """Issue 20: a unit opens its cards by their device nodes' minor numbers, which need not be their indices."""
    env = jinja2.Environment()
    env.filters.update(filters())
    gpus = [{"index": 0, "uuid": "GPU-a", "minor_number": 1}, {"index": 1, "uuid": "GPU-b", "minor_number": 0},
            {"index": 2}]
    minors = env.from_string("{{ item | llama_gpu_minors(gpus) | join(',') }}")
    assert minors.render(item={"gpu_minors": [7]}, gpus=gpus) == "7"  # the plan's, as rendered
    assert minors.render(item={"gpu_minors": []}, gpus=gpus) == ""  # a CPU service: none
    assert minors.render(item={"env": {"CUDA_VISIBLE_DEVICES": "1"}}, gpus=gpus) == "0"
    assert minors.render(item={"env": {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}}, gpus=gpus) == "1,0"
    assert minors.render(item={"env": {"CUDA_VISIBLE_DEVICES": "2,5"}}, gpus=gpus) == "2,5"  # unprobed: the index
    assert minors.render(item={"env": {"CUDA_VISIBLE_DEVICES": "-1"}}, gpus=gpus) == ""  # CUDA sees none
    assert minors.render(item={}, gpus=gpus) == "1,0,2"  # naming none: every card
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES names GPU-c, which llama_service_gpus does not list"):
        minors.render(item={"name": "llama-x", "env": {"CUDA_VISIBLE_DEVICES": "GPU-c"}}, gpus=gpus)
