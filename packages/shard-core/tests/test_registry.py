"""The Registry facade over in-memory plugin managers: lookups, collisions, malformed plugins."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import pluggy
import pytest
import torch
from torch import nn

from shard_core import (
    CpuDeviceHandle,
    LambdaWrapPolicy,
    ModuleWrapPolicy,
    PluginWarning,
    Registry,
    hookimpl,
    make_plugin_manager,
)
from shard_core._version import __version__
from shard_core.errors import (
    PluginCallError,
    PluginCollisionError,
    PluginError,
    UnknownPluginNameError,
    WrapPlanError,
)
from shard_core.plugin import BUILTINS_NAME, PluginOrigin, hookspecs
from shard_core.plugin import _builtins as builtins_plugin
from shard_core.plugin._manager import ShardPluginManager

BUILTIN = f"shard-core {__version__} (built-in)"


def registry(**plugins: object) -> Registry:
    """A registry over a fresh in-memory manager with ``plugins`` registered under their names."""
    pm = make_plugin_manager(load_entry_points=False)
    for name, plugin in plugins.items():
        pm.register(plugin, name=name)
    return Registry(pm)


def comm_hook(reducer: Any, grad: torch.Tensor, output: torch.Tensor | None) -> None:
    reducer.reduce(grad, output)


class WrapPolicies:
    def __init__(self, answer: object) -> None:
        self.answer = answer

    @hookimpl
    def shard_wrap_policies(self) -> object:
        return self.answer


class CommHooks:
    def __init__(self, answer: object) -> None:
        self.answer = answer

    @hookimpl
    def shard_comm_hooks(self) -> object:
        return self.answer


class DeviceHandles:
    def __init__(self, answers: Mapping[str, object]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    @hookimpl
    def shard_device_handle(self, device_type: str) -> object:
        self.asked.append(device_type)
        return self.answers.get(device_type)


class Raising:
    @hookimpl
    def shard_wrap_policies(self) -> object:
        raise RuntimeError("boom")


class OtherCpuHandle(CpuDeviceHandle):
    pass


class XpuHandle(CpuDeviceHandle):
    @property
    def device_type(self) -> str:
        return "xpu"


# - built-ins


def test_builtins_register_through_the_hooks() -> None:
    """A fresh manager has the built-in plugin: two wrap policies, the CPU handle, no comm hook."""
    reg = registry()
    assert reg.plugin_names() == [BUILTINS_NAME]
    assert reg.plugin_manager.get_plugin(BUILTINS_NAME) is builtins_plugin
    assert reg.wrap_policies() == {"lambda": LambdaWrapPolicy, "module_class": ModuleWrapPolicy}
    assert reg.comm_hooks() == {}
    assert isinstance(reg.device_handle("cpu"), CpuDeviceHandle)


def test_wrap_policy_builds_a_registered_policy_with_options() -> None:
    """wrap_policy(name, **options) calls the registered factory with the options."""
    reg = registry()
    policy = reg.wrap_policy("module_class", module_classes=[nn.Linear])
    assert isinstance(policy, ModuleWrapPolicy)
    assert policy.module_classes == (nn.Linear,)
    assert isinstance(reg.wrap_policy("lambda", fn=bool), LambdaWrapPolicy)


def test_third_party_names_merge_with_builtins_sorted() -> None:
    """Names from every plugin appear in one mapping, sorted by name."""
    reg = registry(mine=WrapPolicies({"a_first": LambdaWrapPolicy, "zz_last": ModuleWrapPolicy}))
    assert list(reg.wrap_policies()) == ["a_first", "lambda", "module_class", "zz_last"]
    assert reg.plugin_names() == ["builtins", "mine"]


def test_registry_works_over_a_plain_pluggy_manager() -> None:
    """Registry(pm) accepts any pluggy manager for project shard and names plugins by name."""
    pm = pluggy.PluginManager("shard")
    pm.add_hookspecs(hookspecs)
    pm.register(CommHooks({"x": comm_hook}), name="a")
    pm.register(CommHooks({"x": comm_hook}), name="b")
    reg = Registry(pm)
    assert reg.plugin_names() == ["a", "b"]
    with pytest.warns(PluginWarning, match=r"registered by both plugin 'a' and plugin 'b'"):
        assert reg.comm_hooks() == {}
    with pytest.raises(PluginCollisionError, match=r"registered by both plugin 'a' and plugin 'b'"):
        reg.comm_hook("x")


# - unknown names


def test_unknown_wrap_policy_lists_registered_names_and_suggests() -> None:
    """An unknown name lists what is registered and suggests the closest name."""
    reg = registry()
    with pytest.raises(UnknownPluginNameError) as info:
        reg.wrap_policy("modul_class")
    assert str(info.value) == (
        "no wrap policy is registered as 'modul_class'; registered: 'lambda', 'module_class'. "
        "Did you mean 'module_class'?"
    )
    assert isinstance(info.value, LookupError)


def test_unknown_wrap_policy_without_a_close_name_says_to_install() -> None:
    """Without a close name, the message says to install the plugin that provides it."""
    with pytest.raises(
        UnknownPluginNameError,
        match=r"^no wrap policy is registered as 'blocks'; registered: 'lambda', "
        r"'module_class'. Install the plugin that provides 'blocks'$",
    ):
        registry().wrap_policy("blocks")


def test_unknown_comm_hook_lists_registered_names() -> None:
    """comm_hook with an unknown name lists the registered comm hooks (or none)."""
    with pytest.raises(
        UnknownPluginNameError,
        match=r"^no comm hook is registered as 'powersgd'; registered: none. "
        r"Install the plugin that provides 'powersgd'$",
    ):
        registry().comm_hook("powersgd")
    reg = registry(lowp=CommHooks({"fp16_compress": comm_hook}))
    with pytest.raises(UnknownPluginNameError, match=r"registered: 'fp16_compress'. Did you mean"):
        reg.comm_hook("fp16_compres")


@pytest.mark.parametrize(
    ("lookup", "kind", "name", "distribution", "registered"),
    [
        ("wrap_policy", "wrap policy", "size", "shard-wrap-size", "'lambda', 'module_class'"),
        (
            "wrap_policy",
            "wrap policy",
            "transformer",
            "shard-wrap-transformer",
            "'lambda', 'module_class'",
        ),
        (
            "wrap_policy",
            "wrap policy",
            "name_pattern",
            "shard-wrap-example",
            "'lambda', 'module_class'",
        ),
        ("comm_hook", "comm hook", "fp16_compress", "shard-comm-lowp", "none"),
        ("comm_hook", "comm hook", "bf16_compress", "shard-comm-lowp", "none"),
    ],
)
def test_unknown_shard_owned_name_names_the_distribution_to_install(
    lookup: str, kind: str, name: str, distribution: str, registered: str
) -> None:
    """A name one of shard's plugin distributions provides says which one, and how to install it."""
    with pytest.raises(UnknownPluginNameError) as info:
        getattr(registry(), lookup)(name)
    assert str(info.value) == (
        f"no {kind} is registered as {name!r}; registered: {registered}. {name!r} is provided "
        f"by {distribution}: install it from the shard repository (pip install "
        f"./plugins/{distribution} in a checkout; the shard names on PyPI belong to unrelated "
        "projects)"
    )


def test_owned_name_of_a_distribution_not_loaded_says_why() -> None:
    """When shard-wrap-size was found but blocked, the error says so instead of 'install it'."""
    pm = make_plugin_manager(load_entry_points=False)
    assert isinstance(pm, ShardPluginManager)
    pm.note_not_loaded(
        PluginOrigin("wrap-size", "shard-wrap-size", "0.1.0"), "blocked by SHARD_DISABLE_PLUGINS"
    )
    with pytest.raises(UnknownPluginNameError) as info:
        Registry(pm).wrap_policy("size", min_num_params=10)
    assert str(info.value) == (
        "no wrap policy is registered as 'size'; registered: 'lambda', 'module_class'. 'size' is "
        "provided by shard-wrap-size, which is installed but was not loaded (blocked by "
        "SHARD_DISABLE_PLUGINS)"
    )


def test_owned_name_of_a_loaded_distribution_that_did_not_register_it() -> None:
    """shard-comm-lowp loaded, its answer skipped: the error points at the plugin's warning."""
    pm = make_plugin_manager(load_entry_points=False)
    assert isinstance(pm, ShardPluginManager)
    pm.register(
        Raising(), name="comm-lowp", origin=PluginOrigin("comm-lowp", "shard-comm-lowp", "0.1.0")
    )
    with pytest.raises(UnknownPluginNameError) as info:
        Registry(pm).comm_hook("bf16_compress")
    assert str(info.value) == (
        "no comm hook is registered as 'bf16_compress'; registered: none. 'bf16_compress' is "
        "provided by shard-comm-lowp, which is loaded but did not register it: see the "
        "PluginWarning about shard-comm-lowp, or update it"
    )


def test_comm_hook_returns_the_registered_object() -> None:
    """comm_hook(name) is the exact object the plugin registered."""
    reg = registry(lowp=CommHooks({"fp16_compress": comm_hook}))
    assert reg.comm_hook("fp16_compress") is comm_hook
    assert reg.comm_hooks() == {"fp16_compress": comm_hook}


def test_factory_building_a_non_policy_is_a_plugin_error() -> None:
    """A factory that builds something without descend()/wrap() is blamed on its plugin."""
    reg = registry(sloppy=WrapPolicies({"broken": lambda: 42}))
    with pytest.raises(
        PluginError,
        match=r"^wrap policy 'broken' of plugin 'sloppy' built 42 \(int\), which is not a "
        r"WrapPolicy \(it needs descend\(\) and wrap\(\)\); report this to the plugin's authors$",
    ):
        reg.wrap_policy("broken")


@pytest.mark.parametrize(
    ("name", "options", "problem", "accepted"),
    [
        (
            "module_class",
            {"module_classes": [nn.Linear], "bogus": 1},
            "got an unexpected keyword argument 'bogus'",
            "module_classes",
        ),
        ("module_class", {}, "missing a required argument: 'module_classes'", "module_classes"),
        (
            "lambda",
            {"func": bool, "extra": 2},
            "got an unexpected keyword argument 'func'; got an unexpected keyword argument "
            "'extra'; missing a required argument: 'fn'",
            "fn",
        ),
    ],
)
def test_wrong_options_are_a_wrap_plan_error_naming_the_policy_and_its_options(
    name: str, options: dict[str, Any], problem: str, accepted: str
) -> None:
    """wrap_policy(name, **wrong) lists every problem in a WrapPlanError, not a bare TypeError."""
    with pytest.raises(WrapPlanError) as info:
        registry().wrap_policy(name, **options)
    assert str(info.value) == (
        f"wrap policy {name!r} does not take the options {options!r}: {problem}; its options "
        f"are: {accepted}"
    )
    assert info.value.__cause__ is None
    assert not isinstance(info.value, TypeError)


def test_factory_taking_any_keyword_is_called_and_its_type_error_named() -> None:
    """A factory taking **options is not checked; the TypeError it raises names its plugin."""

    def factory(min_num_params: int = 100, **more: object) -> LambdaWrapPolicy:
        raise TypeError(f"unknown option {next(iter(more))!r}")

    with pytest.raises(TypeError) as info:
        registry(mine=WrapPolicies({"sized": factory})).wrap_policy("sized", leaves=())
    assert isinstance(info.value, PluginCallError)
    assert str(info.value).startswith(
        "wrap policy 'sized' of plugin 'mine' raised TypeError: unknown option 'leaves' when "
        "built with the options {'leaves': ()}. It was raised in your code, module "
        f"{__name__!r} ("
    ), str(info.value)


def test_options_are_shown_with_their_defaults() -> None:
    """The accepted options list keyword arguments with their defaults, keyword-only ones too."""

    def factory(pattern: str, /, flags: int = 0, *, limit: int | None = None) -> LambdaWrapPolicy:
        return LambdaWrapPolicy(bool)

    with pytest.raises(
        WrapPlanError,
        match=r"^wrap policy 'f' does not take the options \{'pattern': 'x'\}: .*; its options "
        r"are: flags=0, limit=None$",
    ):
        registry(mine=WrapPolicies({"f": factory})).wrap_policy("f", pattern="x")


def test_factory_raising_is_a_plugin_call_error_chained_to_the_original() -> None:
    """A factory's KeyError is re-raised naming policy, plugin and options; still a KeyError."""

    def factory(**options: object) -> LambdaWrapPolicy:
        raise KeyError("no such preset")

    reg = registry(mine=WrapPolicies({"preset": factory}))
    with pytest.raises(KeyError) as info:
        reg.wrap_policy("preset", name="tiny")
    error = info.value
    assert isinstance(error, PluginCallError)
    assert type(error.__cause__) is KeyError
    assert str(error).startswith(
        "wrap policy 'preset' of plugin 'mine' raised KeyError: 'no such preset' when built "
        f"with the options {{'name': 'tiny'}}. It was raised in your code, module {__name__!r} ("
        f"{__file__}:"
    ), str(error)


def test_factory_raising_a_shard_error_passes_it_unchanged() -> None:
    """A WrapPlanError a factory raises for a bad option value already names the culprit."""

    def factory(size: int) -> LambdaWrapPolicy:
        raise WrapPlanError(f"size must be positive, got {size}")

    with pytest.raises(WrapPlanError) as info:
        registry(mine=WrapPolicies({"s": factory})).wrap_policy("s", size=-1)
    assert type(info.value) is WrapPlanError
    assert str(info.value) == "size must be positive, got -1"


# - collisions (see [Note: names two plugins claim])


def test_a_collision_disables_only_that_name() -> None:
    """Two plugins claiming "bf16" disable "bf16" alone; their other names and built-ins work."""
    other = CommHooks({"bf16": comm_hook, "only_b": comm_hook})
    reg = registry(a=CommHooks({"bf16": comm_hook}), b=other)
    with pytest.warns(PluginWarning) as warned:
        assert reg.comm_hooks() == {"only_b": comm_hook}
    assert [str(w.message) for w in warned] == [
        "comm hook 'bf16' is registered by both plugin 'a' and plugin 'b', so neither is used; "
        "every other comm hook works. Register the name in one plugin only."
    ]
    assert reg.comm_hook("only_b") is comm_hook
    assert isinstance(reg.wrap_policy("module_class", module_classes=[nn.Linear]), ModuleWrapPolicy)
    with pytest.raises(PluginCollisionError) as info:
        reg.comm_hook("bf16")
    assert str(info.value) == (
        "comm hook 'bf16' is registered by both plugin 'a' and plugin 'b', so it is disabled: "
        "names must be unique across plugins. Register the name in one plugin only."
    )


def test_collision_between_distributions_names_both_and_how_to_block() -> None:
    """Plugins are named by distribution, version and entry point, with the setting to fix it."""
    pm = make_plugin_manager(load_entry_points=False)
    assert isinstance(pm, ShardPluginManager)
    for name, dist, version in [("a", "dist-a", "1.0"), ("b", "dist-b", "2.0")]:
        pm.register(WrapPolicies({"blocks": ModuleWrapPolicy}), name=name)
        pm.note_loaded(PluginOrigin(name, dist, version))
    reg = Registry(pm)
    both = "both dist-a 1.0 (plugin 'a') and dist-b 2.0 (plugin 'b')"
    fix = (
        "Uninstall one of them, or block one with SHARD_DISABLE_PLUGINS=a or "
        "SHARD_DISABLE_PLUGINS=b."
    )
    warning = (
        f"wrap policy 'blocks' is registered by {both}, so neither is used; every other wrap "
        f"policy works. {fix}"
    )
    with (
        pytest.warns(PluginWarning, match=f"^{re.escape(warning)}$"),
        pytest.raises(PluginCollisionError) as info,
    ):
        reg.wrap_policy("blocks")
    assert str(info.value) == (
        f"wrap policy 'blocks' is registered by {both}, so it is disabled: names must be unique "
        f"across plugins. {fix}"
    )
    assert list(reg.wrap_policies()) == ["lambda", "module_class"]


def test_collision_of_three_plugins_names_all_of_them() -> None:
    """With three claimants the message lists all three and says to keep one."""
    pm = make_plugin_manager(load_entry_points=False)
    assert isinstance(pm, ShardPluginManager)
    for name in "abc":
        pm.register(
            CommHooks({"x": comm_hook}), name=name, origin=PluginOrigin(name, f"d-{name}", "1")
        )
    with pytest.warns(PluginWarning), pytest.raises(PluginCollisionError) as info:
        Registry(pm).comm_hook("x")
    assert str(info.value) == (
        "comm hook 'x' is registered by d-a 1 (plugin 'a'), d-b 1 (plugin 'b') and d-c 1 "
        "(plugin 'c'), so it is disabled: names must be unique across plugins. Uninstall all of "
        "them but one, or block the others with SHARD_DISABLE_PLUGINS=a or "
        "SHARD_DISABLE_PLUGINS=b or SHARD_DISABLE_PLUGINS=c."
    )


def test_collision_is_reported_once() -> None:
    """Every lookup after the first sees the same collision without a second warning."""
    reg = registry(a=CommHooks({"x": comm_hook}), b=CommHooks({"x": comm_hook}))
    with pytest.warns(PluginWarning) as warned:
        reg.comm_hooks()
    assert len(warned) == 1
    for _ in range(3):  # no warning: they would be errors here
        assert reg.comm_hooks() == {}
        with pytest.raises(PluginCollisionError):
            reg.comm_hook("x")


def test_a_plugin_cannot_take_a_builtin_name() -> None:
    """A plugin offering "module_class" is ignored for that name, with a warning: built-ins win."""
    pm = make_plugin_manager(load_entry_points=False)
    assert isinstance(pm, ShardPluginManager)
    pm.register(
        WrapPolicies({"module_class": LambdaWrapPolicy, "mine": LambdaWrapPolicy}),
        name="evil",
        origin=PluginOrigin("evil", "shard-evil", "6.6"),
    )
    reg = Registry(pm)
    message = (
        "shard-evil 6.6 (plugin 'evil') registers wrap policy 'module_class', a name built into "
        "shard-core, so the built-in is used and the plugin's wrap policy is ignored. Rename it "
        "in the plugin, or block the plugin with SHARD_DISABLE_PLUGINS=evil to silence this "
        "warning."
    )
    with pytest.warns(PluginWarning, match=f"^{re.escape(message)}$"):
        policies = reg.wrap_policies()
    assert policies == {
        "lambda": LambdaWrapPolicy,
        "mine": LambdaWrapPolicy,
        "module_class": ModuleWrapPolicy,
    }
    assert isinstance(reg.wrap_policy("module_class", module_classes=[nn.Linear]), ModuleWrapPolicy)


def test_an_in_memory_plugin_taking_a_builtin_name_is_told_to_rename() -> None:
    """Without an entry point there is nothing to block: the warning only says to rename."""
    with pytest.warns(
        PluginWarning,
        match=r"^plugin 'mine' registers wrap policy 'lambda', a name built into shard-core, so "
        r"the built-in is used and the plugin's wrap policy is ignored. Rename it in the plugin.$",
    ):
        assert (
            registry(mine=WrapPolicies({"lambda": ModuleWrapPolicy})).wrap_policies()["lambda"]
            is LambdaWrapPolicy
        )


# - malformed answers and raising hooks


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        (["name_pattern"], "expected a mapping of names to wrap-policy factories, got list"),
        ({3: ModuleWrapPolicy}, "names must be non-empty strings, got 3 (int)"),
        ({"": ModuleWrapPolicy}, "names must be non-empty strings, got '' (str)"),
        ({"x": 5}, "'x' maps to 5 (int), which is not callable"),
    ],
)
def test_malformed_wrap_policies_are_skipped_with_a_warning(answer: object, problem: str) -> None:
    """A malformed answer or entry is reported with the plugin's name and the others still work."""
    reg = registry(odd=WrapPolicies(answer))
    if isinstance(answer, Mapping):
        message = (
            f"plugin 'odd' returned malformed entries from shard_wrap_policies(): {problem}; this "
            f"entry was skipped. Report this to the plugin's authors."
        )
    else:
        message = (
            f"plugin 'odd' returned a malformed value from shard_wrap_policies(): {problem}; it "
            f"was skipped. Report this to the plugin's authors."
        )
    with pytest.warns(PluginWarning, match=f"^{re.escape(message)}$"):
        policies = reg.wrap_policies()
    assert list(policies) == ["lambda", "module_class"]


def test_malformed_comm_hooks_are_skipped_with_a_warning() -> None:
    """A comm hook that is not callable skips that plugin's answer, naming its distribution."""
    pm = make_plugin_manager(load_entry_points=False)
    assert isinstance(pm, ShardPluginManager)
    pm.register(CommHooks({"bf16": "not a hook"}), name="lowp")
    pm.note_loaded(PluginOrigin("lowp", "shard-comm-lowp", "0.1.0"))
    message = (
        "shard-comm-lowp 0.1.0 (plugin 'lowp') returned malformed entries from "
        "shard_comm_hooks(): 'bf16' maps to 'not a hook' (str), which is not callable; this "
        "entry was skipped. Report this to the authors of shard-comm-lowp, or block it with "
        "SHARD_DISABLE_PLUGINS=lowp."
    )
    with pytest.warns(PluginWarning, match=f"^{re.escape(message)}$"):
        assert Registry(pm).comm_hooks() == {}


def test_a_raising_hook_is_skipped_with_a_warning() -> None:
    """A hook that raises is reported with the exception and the other plugins still answer."""
    reg = registry(bad=Raising())
    with pytest.warns(
        PluginWarning,
        match=r"^plugin 'bad' raised RuntimeError: boom in shard_wrap_policies\(\); its answer "
        r"was skipped. Report this to the plugin's authors.$",
    ):
        assert list(reg.wrap_policies()) == ["lambda", "module_class"]


def test_partly_malformed_answer_keeps_its_valid_entries_and_lists_every_problem() -> None:
    """Each bad entry is skipped and named in one warning; the plugin's valid entries are used."""
    answer = {"good": LambdaWrapPolicy, 3: ModuleWrapPolicy, "x": 5, "also_good": ModuleWrapPolicy}
    reg = registry(odd=WrapPolicies(answer))
    message = (
        "plugin 'odd' returned malformed entries from shard_wrap_policies(): names must be "
        "non-empty strings, got 3 (int); 'x' maps to 5 (int), which is not callable; these 2 "
        "were skipped, its other entries are used ('good', 'also_good'). Report this to the "
        "plugin's authors."
    )
    with pytest.warns(PluginWarning, match=f"^{re.escape(message)}$"):
        policies = reg.wrap_policies()
    assert list(policies) == ["also_good", "good", "lambda", "module_class"]
    assert isinstance(reg.wrap_policy("good", fn=bool), LambdaWrapPolicy)


def test_mapping_that_cannot_be_read_is_skipped() -> None:
    """A mapping whose items() raises is reported like any malformed answer."""

    class Unreadable(dict[str, Any]):
        def items(self) -> Any:
            raise RuntimeError("locked")

    with pytest.warns(
        PluginWarning,
        match=r"^plugin 'odd' returned a malformed value from shard_comm_hooks\(\): reading the "
        r"mapping raised RuntimeError: locked; it was skipped.",
    ):
        assert registry(odd=CommHooks(Unreadable())).comm_hooks() == {}


def test_malformed_plugin_is_reported_once_per_process() -> None:
    """A warning is shown once by its manager, even when plugins change and answers are re-read."""
    reg = registry(bad=Raising())
    with pytest.warns(PluginWarning) as first:
        reg.wrap_policies()
    reg.wrap_policies()
    assert isinstance(reg.wrap_policy("lambda", fn=bool), LambdaWrapPolicy)
    assert len(first) == 1
    reg.plugin_manager.register(WrapPolicies({"extra": LambdaWrapPolicy}), name="extra")
    assert list(reg.wrap_policies()) == ["extra", "lambda", "module_class"]  # no warning again


def test_hook_wrappers_are_reported_and_ignored() -> None:
    """A hook wrapper on a shard hook is not supported: it is reported and not run."""

    class Wrapper:
        @hookimpl(wrapper=True)
        def shard_wrap_policies(self) -> Iterator[None]:
            raise AssertionError("a wrapper must not run")
            yield

    with pytest.warns(
        PluginWarning,
        match=r"^plugin 'wrapping' wraps shard_wrap_policies\(\); shard's registry calls each "
        r"plugin's hook on its own and ignores hook wrappers: implement the hook itself instead$",
    ):
        assert list(registry(wrapping=Wrapper()).wrap_policies()) == ["lambda", "module_class"]


# - device handles


def test_device_handle_is_the_builtin_cpu_handle_and_cached() -> None:
    """ "cpu" resolves to the built-in handle, the same object on every call."""
    reg = registry()
    handle = reg.device_handle("cpu")
    assert handle is reg.device_handle("cpu")
    assert (handle.device_type, handle.backend) == ("cpu", "gloo")


def test_third_party_device_handle_is_asked_before_the_builtin() -> None:
    """A plugin answering for "cpu" wins over the built-in CPU handle."""
    mine = OtherCpuHandle()
    assert registry(mine=DeviceHandles({"cpu": mine})).device_handle("cpu") is mine


def test_first_device_handle_answer_wins() -> None:
    """Plugins are asked last-registered first, and asking stops at the first answer."""
    first, second = OtherCpuHandle(), OtherCpuHandle()
    early, late = DeviceHandles({"cpu": first}), DeviceHandles({"cpu": second})
    reg = registry(early=early, late=late)
    assert reg.device_handle("cpu") is second
    assert (early.asked, late.asked) == ([], ["cpu"])


def test_malformed_device_handle_is_skipped_for_the_next_answer() -> None:
    """An answer that is not a DeviceHandle is reported and the built-in CPU handle is used."""
    reg = registry(odd=DeviceHandles({"cpu": object()}))
    with pytest.warns(
        PluginWarning,
        match=r"^plugin 'odd' returned a malformed value from shard_device_handle\(\): object is "
        r"not a DeviceHandle \(see shard_core.protocols: device_type, backend, streams, events, "
        r"memory_stats...\); it was skipped. Report this to the plugin's authors.$",
    ):
        handle = reg.device_handle("cpu")
    assert isinstance(handle, CpuDeviceHandle)
    assert type(handle) is CpuDeviceHandle


def test_device_handle_for_the_wrong_type_is_skipped() -> None:
    """A handle answered for another device type than asked is reported and not used."""
    reg = registry(odd=DeviceHandles({"xpu": CpuDeviceHandle()}))
    with (
        pytest.warns(
            PluginWarning,
            match=r"shard_device_handle\(\): asked for device type 'xpu', it answered a handle "
            r"for 'cpu'; it was skipped",
        ),
        pytest.raises(UnknownPluginNameError, match=r"install shard-device-accel"),
    ):
        reg.device_handle("xpu")


def test_third_party_handle_for_another_type_resolves() -> None:
    """A plugin serving a device type shard-core does not know is found by that type."""
    handle = XpuHandle()
    assert registry(accel=DeviceHandles({"xpu": handle})).device_handle("xpu") is handle


@pytest.mark.parametrize(
    ("device_type", "distribution"),
    [
        ("cuda", "shard-device-cuda"),
        ("xpu", "shard-device-accel"),
        ("hpu", "shard-device-accel"),
        ("npu", "shard-device-accel"),
        ("mps", "shard-device-accel"),
    ],
)
def test_unknown_device_type_names_the_distribution_to_install(
    device_type: str, distribution: str
) -> None:
    """With no plugin for a known accelerator, the error names the distribution to install."""
    with pytest.raises(UnknownPluginNameError) as info:
        registry().device_handle(device_type)
    assert str(info.value) == (
        f"no shard plugin serves device type {device_type!r}: install {distribution} "
        f"from the shard repository (pip install ./plugins/{distribution} in a checkout; the "
        "shard names on PyPI belong to unrelated projects)"
    )


def test_unknown_device_type_without_a_known_distribution_lists_plugins() -> None:
    """An exotic device type lists the plugins asked and the hook that would serve it."""
    with pytest.raises(
        UnknownPluginNameError,
        match=r"^no shard plugin serves device type 'tpu'; plugins asked: builtins, mine. A "
        r"plugin provides a device handle through the shard_device_handle hook$",
    ):
        registry(mine=DeviceHandles({})).device_handle("tpu")


def test_installed_device_plugin_that_declines_is_named() -> None:
    """When the right distribution is loaded but answers None, the error asks about the device."""
    pm = make_plugin_manager(load_entry_points=False)
    assert isinstance(pm, ShardPluginManager)
    pm.register(DeviceHandles({}), name="cuda")
    pm.note_loaded(PluginOrigin("cuda", "shard-device-cuda", "0.1.0"))
    with pytest.raises(
        UnknownPluginNameError,
        match=r"^no shard plugin serves device type 'cuda': shard-device-cuda is installed but "
        r"did not serve it; is a 'cuda' device present, and supported by this build of torch\?$",
    ):
        Registry(pm).device_handle("cuda")


def test_installed_device_plugin_that_was_not_loaded_says_why() -> None:
    """When the right distribution was found but not loaded, the error gives the reason."""
    pm = make_plugin_manager(load_entry_points=False)
    assert isinstance(pm, ShardPluginManager)
    pm.note_not_loaded(
        PluginOrigin("cuda", "shard-device-cuda", "0.1.0"), "blocked by SHARD_DISABLE_PLUGINS"
    )
    with pytest.raises(
        UnknownPluginNameError,
        match=r"^no shard plugin serves device type 'cuda': shard-device-cuda is installed but "
        r"was not loaded \(blocked by SHARD_DISABLE_PLUGINS\)$",
    ):
        Registry(pm).device_handle("cuda")


def test_device_handle_cache_is_dropped_when_plugins_change() -> None:
    """Registering a plugin after a lookup lets it answer the next lookup."""
    reg = registry()
    builtin = reg.device_handle("cpu")
    mine = OtherCpuHandle()
    reg.plugin_manager.register(DeviceHandles({"cpu": mine}), name="mine")
    assert reg.device_handle("cpu") is mine
    reg.plugin_manager.unregister(name="mine")
    assert reg.device_handle("cpu") is builtin
