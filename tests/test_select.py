import re

import pytest
import torch.nn as nn

import hookscope as hs


def net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU())),
        nn.Linear(8, 2),
    )


def test_exact_name_and_root() -> None:
    model = net()
    assert list(hs.select(model, "1.2.0")) == ["1.2.0"]
    assert hs.select(model, "")[""] is model


def test_star_stays_inside_one_segment() -> None:
    assert list(hs.select(net(), "*")) == ["0", "1", "2"]
    assert list(hs.select(net(), "1.*")) == ["1.0", "1.1", "1.2"]


def test_double_star_crosses_segments_but_never_matches_root() -> None:
    model = net()
    every = [name for name, _ in model.named_modules() if name]
    assert list(hs.select(model, "**")) == every
    assert list(hs.select(model, "**.1")) == ["1", "1.1", "1.2.1"]
    assert list(hs.select(model, "1.**")) == ["1.0", "1.1", "1.2", "1.2.0", "1.2.1"]
    assert list(hs.select(model, "1.**.0")) == ["1.0", "1.2.0"]


def test_regex_type_predicate_and_union_keep_module_order() -> None:
    model = net()
    assert list(hs.select(model, re.compile(r"1\.\d"))) == ["1.0", "1.1", "1.2"]
    assert list(hs.select(model, nn.ReLU)) == ["1.1", "1.2.1"]
    assert list(hs.select(model, lambda name, m: name.endswith("0"))) == ["0", "1.0", "1.2.0"]
    assert list(hs.select(model, ["2", nn.ReLU, "0"])) == ["0", "1.1", "1.2.1", "2"]


def test_unknown_name_suggests_close_names() -> None:
    with pytest.raises(hs.SelectionError, match=r"Did you mean .*'1\.2\.0'") as info:
        hs.select(net(), "1.2.O")
    assert isinstance(info.value, LookupError)


def test_glob_that_matches_nothing_explains_globs() -> None:
    with pytest.raises(hs.SelectionError, match="matched no module"):
        hs.select(net(), "blocks.*.attn")


def test_typo_inside_a_list_is_an_error_even_if_others_match() -> None:
    with pytest.raises(hs.SelectionError, match="'fc9'"):
        hs.select(net(), ["0", "fc9"])


def test_type_that_is_not_a_module_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="nn.Module subclass"):
        hs.select(net(), int)
    with pytest.raises(TypeError, match="where must be"):
        hs.select(net(), 3)  # type: ignore[arg-type]


def test_predicate_that_matches_nothing_names_the_predicate() -> None:
    def no_conv(name: str, module: nn.Module) -> bool:
        return isinstance(module, nn.Conv2d)

    with pytest.raises(hs.SelectionError, match="no_conv"):
        hs.select(net(), no_conv)
