"""box_hand_over, the seal's last step: which files hold authorized keys for an account (sshd's own patterns), what
sshd would let in some other way, which passwords open an account, and the builder's sudo rules taken out of
sudoers text without touching anyone else's. The module on a real box: tests/integration/test_seal.py."""

from __future__ import annotations

import pwd

import pytest
import yaml

from tests.unit.plugins.loader import load_module

hand_over = load_module("box_hand_over")

BUILDER = {"builder", "#1001"}
SSHD_T = """port 22
authorizedkeysfile .ssh/authorized_keys /etc/ssh/keys/%u %h/.ssh/extra_%U
authorizedkeyscommand none
authorizedprincipalscommand none
trustedusercakeys none
"""


def _account(name: str = "alice", home: str = "/home/alice", uid: int = 1002) -> pwd.struct_passwd:
    return pwd.struct_passwd((name, "x", uid, uid, "", home, "/bin/bash"))


def test_the_key_files_are_sshds_own_and_always_the_default_ones():
    options = hand_over.parse_sshd_t(SSHD_T)
    patterns = hand_over.key_file_patterns(options)
    assert patterns == [".ssh/authorized_keys", "/etc/ssh/keys/%u", "%h/.ssh/extra_%U", ".ssh/authorized_keys2"]
    assert [hand_over.expand(pattern, _account()) for pattern in patterns] == [
        "/home/alice/.ssh/authorized_keys", "/etc/ssh/keys/alice", "/home/alice/.ssh/extra_1002",
        "/home/alice/.ssh/authorized_keys2"]
    assert hand_over.key_file_patterns({"authorizedkeysfile": "none"}) == hand_over.DEFAULT_KEY_FILES
    assert hand_over.expand("%%h/%u", _account()) == "/home/alice/%h/alice"


def test_logins_sshd_grants_without_a_key_file_are_named():
    assert hand_over.other_ways_in(hand_over.parse_sshd_t(SSHD_T)) == []
    options = hand_over.parse_sshd_t(SSHD_T.replace("trustedusercakeys none", "trustedusercakeys /etc/ssh/ca.pub"))
    assert hand_over.other_ways_in(options) == ["trustedusercakeys /etc/ssh/ca.pub"]


@pytest.mark.parametrize(("field", "opens"), [("$y$j9T$abc$def", True), ("", True), ("!$y$j9T$abc", False),
                                              ("!", False), ("*", False), ("!*", False)])
def test_a_password_opens_an_account_unless_it_is_locked_or_none(field, opens):
    assert hand_over.password_opens(field) is opens


def test_the_builders_own_rule_goes_and_its_file_is_left_without_rules():
    text = "# the builder's\nbuilder ALL=(ALL) NOPASSWD: ALL\nDefaults:builder !requiretty\n"
    new, changed = hand_over.strip_sudoers(text, BUILDER)
    assert changed and new == "# the builder's\n" and not hand_over.has_rules(new)


def test_everyone_elses_rules_stay_as_they_were():
    text = ("Defaults\tenv_reset\nroot\tALL=(ALL:ALL) ALL\n%sudo\tALL=(ALL:ALL) ALL\n@includedir /etc/sudoers.d\n"
            "#includedir /etc/sudoers.d\nbuilders_friend ALL=(ALL) ALL\nCmnd_Alias BUILD = /usr/bin/make\n"
            "# builder ALL=(ALL) ALL is only a comment\n")
    assert hand_over.strip_sudoers(text, BUILDER) == (text, False)
    assert hand_over.has_rules(text)


def test_a_shared_rule_keeps_the_others_and_a_negation_stays():
    text = ("alice, builder ,bob ALL=(ALL) ALL\n#1001 ALL=(ALL) NOPASSWD: ALL\nALL, !builder ALL=/usr/bin/id\n"
            "Defaults:alice,builder !lecture\nUser_Alias ADMINS = carol, builder : OPS = builder, dave\n"
            "builder \\\n    ALL=(ALL) ALL\n")
    new, changed = hand_over.strip_sudoers(text, BUILDER)
    assert changed
    assert new == ("alice, bob ALL=(ALL) ALL\nALL, !builder ALL=/usr/bin/id\nDefaults:alice !lecture\n"
                   "User_Alias ADMINS = carol : OPS = dave\n")


def test_an_alias_of_only_the_builder_is_left_to_a_person():
    with pytest.raises(hand_over.Refused, match="User_Alias BUILDERS names only"):
        hand_over.strip_sudoers("User_Alias BUILDERS = builder\nBUILDERS ALL=(ALL) ALL\n", BUILDER)


def test_the_documented_options_are_the_argument_spec():
    documented = yaml.safe_load(hand_over.DOCUMENTATION)["options"]
    assert {name: (option["type"], option["default"]) for name, option in documented.items()} == {
        name: (spec["type"], spec["default"]) for name, spec in hand_over.ARGUMENT_SPEC.items()}


def test_an_alias_line_that_never_named_the_builder_stays_byte_for_byte():
    text = "builder ALL=(ALL) NOPASSWD: ALL\nUser_Alias  OPS=alice,bob\n"
    assert hand_over.strip_sudoers(text, {"builder"}) == ("User_Alias  OPS=alice,bob\n", True)
