"""The field checks shared by every config class (size parsing: tests/test_config.py)."""

import dataclasses

import pytest

from gdskv.config_fields import MAX_WAIT_S, check_bytes, check_choice, check_positive, check_wait, construct, registered
from gdskv.errors import ConfigError


def test_checks_name_their_field():
    for check, bad in ((check_bytes, -1), (check_positive, 0), (check_wait, -1.0)):
        with pytest.raises(ConfigError) as info:
            check("x", bad)
        assert info.value.context["field"] == "x"
    with pytest.raises(ConfigError, match="at most 4 \\(why\\)"):
        check_positive("x", 5, maximum=4, why=" (why)")
    assert check_wait("x", MAX_WAIT_S) == MAX_WAIT_S
    with pytest.raises(ConfigError, match="a year"):
        check_wait("x", MAX_WAIT_S + 1)
    with pytest.raises(ConfigError, match="positive"):
        check_wait("x", 0, positive=True)


def test_a_choice_lists_the_valid_ones_and_names_the_field_when_told():
    with pytest.raises(ConfigError) as info:
        check_choice("colour", "red", ("blue", "green"), field="colour")
    assert info.value.context == {"field": "colour", "got": "red", "valid": "blue, green"}
    with pytest.raises(ConfigError) as info:
        check_choice("colour", "red", ("blue",))
    assert "field" not in info.value.context
    with pytest.raises(ConfigError) as info:
        registered("colour", "red", {"green": 1, "blue": 2})
    assert info.value.context["valid"] == "blue, green"


def test_construct_refuses_an_unknown_option():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Thing:
        size: int = 1

    assert construct(Thing, {"size": 2}, what="a thing") == Thing(size=2)
    with pytest.raises(ConfigError, match="unknown option of a thing") as info:
        construct(Thing, {"colour": "red"}, what="a thing")
    assert info.value.context == {"got": "colour", "valid": "size"}
