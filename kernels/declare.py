"""Declare a kernel once: ``Kernel(...)`` is everything tritune needs to check, serve and tune it.

A declaration names the kernel's arguments (:mod:`.arguments`), its config space, its tuning key,
its portable default, its launch, its reference and its Triton kernels. From it the framework
derives, the same way for the built-in kernels and for users' own:

- the input checks: a generated one-pass check for plain eager calls (:mod:`.fastcheck`) and the
  detailed checks that name the argument, from the same declaration so they cannot disagree;
- the ``torch.library`` op (``tritune::<name>`` unless named otherwise, :mod:`.kernel_op`), whose
  schema passes the config's fields by name, so ``torch.compile(fullgraph=True)``, CUDA-graph
  capture and ``opcheck`` work; plain eager calls skip the op's Python layers and launch directly;
- dispatch: the stored winner for the call's key, else a near bucket's, else the portable default
  (:mod:`.dispatcher`), and the kernel's version (:mod:`.versioning`);
- registration with the tuner and the CLI (``tune --kernel <name>`` or ``module:ATTRIBUTE``).

The tuning half (problem generator, accuracy check, default keys, seeds) is a separate object,
named by ``tuning="module:attribute"`` and imported only by the tuner, so serving never loads it.
A worked example is ``examples/rmsnorm.py``; docs/ARCHITECTURE.md walks through adding a kernel.
"""

from __future__ import annotations

import collections
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

from . import registry
from ._autograd import needs_grad, warn_forward_only
from ._early_key import build_early_key
from ._launch import prepare_interpreter, same_layout
from ._oplib import no_modes, register_schema_op, run_unwrapped
from ._replay import INPUT, OBJECT, OUTPUT, RAN, SCALAR, LaunchPlans
from .arguments import CheckedCall, Derived, Obj, Output, Rule, Scalar, Tensor, dim_names, dtype_name, static_dim
from .device import DeviceInfo, make_current
from .dispatcher import EagerChoice, dispatch_choice_eager, dispatch_config
from .fastcheck import FastCheck, build_fast_check
from .kernel_op import KernelOp
from .spec import KernelSpec, Peer, Problem, Replaced, TuningKey
from .tuning_half import KernelTuning

__all__ = ["Derived", "Kernel", "KernelTuning", "Obj", "Output", "Rule", "Scalar", "Tensor"]


class Kernel(KernelOp, KernelSpec[Any, Any]):
    """One kernel's declaration (see the module docstring). Calling it runs the kernel.

    ``arguments``: the call's arguments in order (:class:`Tensor`, :class:`Obj`, :class:`Scalar`,
    :class:`Output`); the first must be a required tensor (its device and dtype lead).
    ``facts``: the names the tuning key and ``serve`` may read, in order: ``"dtype"`` (the first
    tensor's), dim names, scalar names, ``"has_<optional arg>"`` and :class:`Derived` names.
    ``key(device, facts)`` builds the ``key_type`` key. ``launch(config, *arguments)`` runs the
    kernel on checked arguments (outputs allocated, scalars resolved), launching through
    ``wrap_triton(kernel)[grid](...)``. ``reference(**inputs)`` computes the same in fp32 or better.
    ``default(key)``, ``pin(values)`` and ``serve(config, device, facts)`` are optional hooks for
    a key-dependent portable default, ``use_config`` parsing and last-moment path eligibility;
    ``serve`` returns the config that serves, or a :class:`~.spec.Replaced` naming the stand-in
    and why the given config cannot serve (the pin warning quotes it).
    ``fallback_key(key)`` names the key whose winner serves where ``key`` has none (see
    :meth:`KernelSpec.fallback_key`). ``dynamic``: dim facts left symbolic under ``torch.compile``
    (0 in the facts) instead of specialising the graph on them. ``protocol`` is bumped by hand
    when launch geometry or the timing method changes (see :mod:`.versioning`).
    """

    def __init__(
        self,
        name: str,
        *,
        arguments: Sequence[Tensor | Obj | Scalar | Output],
        facts: Sequence[str],
        space: Any,
        key_type: type[TuningKey],
        key: Callable[[DeviceInfo, Any], TuningKey],
        launch: Callable[..., None],
        reference: Callable[..., torch.Tensor],
        jit_kernels: Sequence[Any],
        protocol: int,
        rules: Sequence[Rule] = (),
        derived: Sequence[Derived] = (),
        dynamic: Sequence[str] = (),
        default: Callable[[Any], Any] | None = None,
        pin: Callable[[Mapping[str, Any]], Any] | None = None,
        serve: Callable[[Any, DeviceInfo, Any], Any] | None = None,
        fallback_key: Callable[[Any], Any] | None = None,
        tuning: str | KernelTuning | None = None,
        op_name: str | None = None,
        replay: bool = True,
    ) -> None:
        self.name = name
        self.arguments = tuple(arguments)
        self.rules = tuple(rules)
        self.derived = tuple(derived)
        self.fact_names = tuple(facts)
        self.dynamic = frozenset(dynamic)
        self.space = space
        self.key_type = key_type
        self.jit_kernels = tuple(jit_kernels)
        self.protocol = protocol
        self._key = key
        self._launch = launch
        self._reference = reference
        self._default = default
        self._pin = pin
        self._serve = serve
        self._fallback_key = fallback_key
        self._tuning = tuning
        self.Facts = collections.namedtuple(f"{_camel(name)}Facts", self.fact_names)  # type: ignore[misc]
        self._by_name = {a.name: a for a in self.arguments}
        self._outputs = tuple(a for a in self.arguments if isinstance(a, Output))
        self._output_positions = tuple(i for i, a in enumerate(self.arguments) if isinstance(a, Output))
        self._tensor_positions = tuple(i for i, a in enumerate(self.arguments) if isinstance(a, Tensor | Output))
        self._objects = tuple((i, a.split) for i, a in enumerate(self.arguments) if isinstance(a, Obj))
        self._scalar_positions = tuple(i for i, a in enumerate(self.arguments) if isinstance(a, Scalar))
        self._validate()
        #: Whether CPU tensors may run: the kernels were decorated under TRITON_INTERPRET=1.
        self.cpu_allowed = any(isinstance(k, InterpretedFunction) for k in self.jit_kernels)
        #: Interpreted kernels launch nothing a recording sees: they are never replayed.
        self._plans = LaunchPlans(name) if replay and not self.cpu_allowed else None
        # The arguments in the order of _replayed's tensors, then the scalars (see _early_key).
        objects = [(i, a) for i, a in enumerate(self.arguments) if isinstance(a, Obj)]
        self._early_layout = (
            *((i, OUTPUT if isinstance(self.arguments[i], Output) else INPUT, None) for i in self._tensor_positions),
            *((i, OBJECT, (obj.type, obj.split, len(obj.parts))) for i, obj in objects),
            *((i, SCALAR, None) for i in self._scalar_positions),
        )
        optional = frozenset(i for i in self._tensor_positions if getattr(self.arguments[i], "optional", False))
        self._early_key = None if self._plans is None else build_early_key(self._early_layout, optional)
        #: Where each output's address goes among the early key's addresses.
        self._output_slots = tuple(n for n, i in enumerate(self._tensor_positions) if i in self._output_positions)
        self._fast: FastCheck | None = None
        self._signature = inspect.Signature(
            [
                inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=_default_of(a))
                for a in self.arguments
            ]
        )
        self._config_cache: dict[tuple[Any, ...], Any] = {}
        # Before the op is registered: a clash of names must not rebind the other kernel's op.
        registry.check_name(self)
        self.op = register_schema_op(
            op_name or f"tritune::{name}",
            self._op_body,
            self.schema(),
            mutated=self._op_output_positions(),
            opaque=self.cpu_allowed,
        )
        registry.register(self)

    # ---- the declaration ---------------------------------------------------------------------

    def _validate(self) -> None:
        names = [a.name for a in self.arguments]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: argument names repeat: {names}")
        dims = set(dim_names(self.arguments))
        known = set(names) | dims | {d.name for d in self.derived} | {"dtype"}
        known |= {f"has_{a.name}" for a in self.arguments if isinstance(a, Tensor | Scalar) and a.optional}
        unknown = [f for f in self.fact_names if f not in known]
        if unknown:
            raise ValueError(f"{self.name}: facts {unknown} name no argument, dim or derived fact")
        for rule in self.rules:
            missing = [p for p in rule.params if p not in known]
            if missing:
                raise ValueError(f"{self.name}: rule on {rule.arg} reads unknown names {missing}")
        # A dim only an optional tensor binds has no value when it is None: nothing else may read it.
        binding = [a for a in self.arguments if isinstance(a, Tensor | Obj) and not getattr(a, "optional", False)]
        loose = dims - set(dim_names(binding))
        readers = {
            "facts": set(self.fact_names),
            "rules": {p for rule in self.rules for p in rule.params},
            "outputs": set(dim_names([a for a in self.arguments if isinstance(a, Output)])),
        }
        for what, names_read in readers.items():
            if names_read & loose:
                raise ValueError(
                    f"{self.name}: {what} read dims {sorted(names_read & loose)}, which only optional tensors bind"
                )

    # ---- the call ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the kernel: arguments as declared, positionally or by name."""
        if kwargs or len(args) != len(self.arguments):
            args = self._bind(args, kwargs)
        return self.call(*args)

    def call(self, *args: Any) -> Any:
        """:meth:`__call__` with every argument given positionally (what the public wrappers use)."""
        return self._run(args, None)

    def _call_early(
        self, plans: LaunchPlans, early: tuple[tuple[Any, ...], list[int], list[torch.Tensor | None]]
    ) -> Any:
        """A call whose raw arguments' layout was replayed after its checks before: dispatch on
        that call's facts and replay the config's plan, skipping the checks (which depend on that
        layout alone). None: the call goes the checked way."""
        key, addresses, tensors = early
        entry = plans.early(key)
        if entry is None:
            return None
        config = dispatch_choice_eager(self.name, entry.device, entry.facts)
        if type(config) is EagerChoice:
            config, first = config.for_call()
            if first is not None:
                return None
        outputs = plans.replay_early(entry, config, key[1], addresses, self._output_slots, tensors)
        if outputs is None:
            return None
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _call_fast(
        self, facts: Any, device: torch.device, args: tuple[Any, ...], early: tuple[Any, ...] | None = None
    ) -> Any:
        """A call the fast check accepted: dispatch, then the direct launch (or its replay) or the op.

        ``early``: the call's raw-argument key (:mod:`._early_key`), remembered with its
        facts once the call replays, so that its layout's next calls skip the checks.

        Tensors on another GPU than the current one: the call runs with their device made current
        (Triton launches on the current device), and its layout is never remembered for an early
        replay, which launches on the current device and stream its key holds."""
        current = make_current(device)
        if current is not None:
            with current:
                return self._call_fast(facts, device, args)
        if _empty(args, self._output_positions):
            return self._result(args)
        config = dispatch_choice_eager(self.name, device, facts)
        choice = first = None
        if type(config) is EagerChoice:
            choice, (config, first) = config, config.for_call()
        grad = needs_grad(args, self._tensor_positions)
        if grad is not None:
            warn_forward_only(self.name, self.arguments[grad].name)
        direct = no_modes() and grad is None
        if direct and self.cpu_allowed:
            # Reading device.type builds a string per call; only interpreted kernels run on the CPU.
            prepare_interpreter()
        if choice is not None and first is not None:
            # The winner, once, on outputs laid out as the caller's: a later capture finds it loaded.
            scratch = self._scratch_outputs(args)
            if direct:
                run_unwrapped(self._launch, (first, *scratch), ())
            else:
                self._call_op(first, scratch)
            choice.graph_loaded = True
        if direct:
            plans = self._plans
            plan = None if plans is None or first is not None else self._replayed(plans, config, args, device)
            if plan is None:
                run_unwrapped(self._launch, (config, *args), [args[i] for i in self._output_positions])
            elif early is not None and plan is not RAN:
                outputs = [args[i] for i in self._output_positions]
                plans.remember_early(early[0], facts, device, outputs, config, plan)
        else:
            self._call_op(config, args)
        return self._result(args)

    def _replayed(self, plans: LaunchPlans, config: Any, args: tuple[Any, ...], device: torch.device) -> Any:
        """Run the call's launches from its layout's recording, or record them (see :mod:`._replay`):
        what :meth:`LaunchPlans.run` returns (None: nothing ran).

        The fast check has found the outputs apart from the inputs, as the launch function needs."""
        tensors = [args[i] for i in self._tensor_positions]
        for i, split in self._objects:
            tensors += split(args[i])
        scalars = tuple(args[i] for i in self._scalar_positions)
        ran = plans.run(self._launch, config, args, tensors, scalars, device)
        if ran is not None:
            for i in self._output_positions:
                torch.autograd.graph.increment_version(args[i])
        return ran

    def _scratch_outputs(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` with each output replaced by a fresh tensor of its dtype, shape, strides and base
        alignment (what Triton specializes on): the winner's one launch for a call's facts (so that a
        CUDA-graph capture finds the kernel it will launch loaded) must leave the caller's outputs to
        the config that serves the call, whatever the kernel does with them."""
        scratch = list(args)
        for i in self._output_positions:
            scratch[i] = same_layout(args[i])
        return tuple(scratch)

    def _call_checked(self, args: tuple[Any, ...], names: dict[str, str] | None = None) -> Any:
        """The detailed path: checks that name the argument, then dispatch through the op."""
        facts, device, args = self.check_call(args, names)
        if device.type == "meta":
            # The checks let meta tensors through for launch(), where a recorder may stand in for
            # Triton; a call has nowhere to run.
            first = self.arguments[0].name
            raise ValueError(
                f"{(names or {}).get(first, first)}: expected a CUDA tensor (or a CPU one on the Triton "
                "interpreter), got device meta"
            )
        if _empty(args, self._output_positions):
            return self._result(args)
        index = -1 if device.index is None else device.index
        config = dispatch_config(self.name, device.type, index, tuple(facts))
        if device.type == "cpu":
            _prepare_interpreter()
        current = make_current(device)
        if current is None:
            self._call_op(config, args)
        else:
            with current:  # tensors on another GPU than the current one (see _call_fast)
                self._call_op(config, args)
        return self._result(args)

    def call_named(self, args: tuple[Any, ...], names: dict[str, str] | None) -> Any:
        """Run a call whose errors name the arguments as ``names`` maps them (a wrapper's own names).

        ``args``: every argument, positionally (as :meth:`call` takes them). A call the fast check
        accepts runs the check once; a call whose raw arguments' layout was replayed after its
        checks before replays without them (:meth:`_call_early`).
        """
        return self._run(args, names)

    def _run(self, args: tuple[Any, ...], names: dict[str, str] | None) -> Any:
        early = None
        plans = self._plans
        # Not while compiling: dynamo traces this function, and a traced call has no layout to replay.
        if plans is not None and plans.recording_started and not torch.compiler.is_compiling():
            early = self._early_key(args)  # type: ignore[misc]  # built wherever there are plans
            if early is not None:
                result = self._call_early(plans, early)
                if result is not None:
                    return result
        fast = self._fast
        if fast is None:
            if torch.compiler.is_compiling():
                # A first call under torch.compile: dynamo cannot trace building the check (it
                # compiles generated text), and the check would defer a traced call anyway.
                return self._call_checked(args, names)
            fast = self._fast = self.fast_check()
        try:
            checked = fast.fn(*args)
        except Exception:  # an argument it cannot read (a nested tensor has no sizes): the checks name it
            checked = None
        if checked is not None:
            return self._call_fast(*checked, early)
        return self._call_checked(args, names)

    def check_call(
        self, args: tuple[Any, ...], names: dict[str, str] | None = None
    ) -> tuple[Any, torch.device, tuple[Any, ...]]:
        """Detailed checks (errors name the argument): ``(facts, device, args)`` with outputs allocated."""
        values = dict(zip((a.name for a in self.arguments), args, strict=True))
        checked = CheckedCall(self.arguments, self.rules, values, names, self.cpu_allowed)
        inputs = {a.name: values[a.name] for a in self.arguments if isinstance(a, Tensor)}
        for a in self.arguments:
            if isinstance(a, Obj):
                inputs.update(zip((f"{a.name}.{part}" for part in a.parts), a.split(values[a.name]), strict=True))
        for a in self._outputs:
            checked.check_output(a, values[a.name], inputs)
        assert checked.device is not None
        for a in self.arguments:
            if isinstance(a, Scalar):
                value = values[a.name]
                if value is None and a.resolve is not None:
                    value = a.resolve(*(checked.dims[p] for p in inspect.signature(a.resolve).parameters))
                elif value is not None and a.type is float:
                    value = float(value)
                values[a.name] = value
        for a in self._outputs:
            if values[a.name] is None:
                like = values[a.like]
                if a.keep_layout and a.dims is None:
                    values[a.name] = torch.empty_like(like)
                else:
                    values[a.name] = torch.empty(checked.output_shape(a), dtype=like.dtype, device=checked.device)
        derived = {d.name: d.compute(*(values[p] for p in d.params)) for d in self.derived}
        facts = []
        for fact in self.fact_names:
            if fact == "dtype":
                facts.append(dtype_name(values[self.arguments[0].name].dtype))
            elif fact in derived:
                facts.append(derived[fact])
            elif fact in checked.dims:
                facts.append(static_dim(checked.dims[fact], fact in self.dynamic))
            elif fact.startswith("has_") and fact[4:] in values:
                facts.append(values[fact[4:]] is not None)
            else:
                facts.append(values[fact])
        return self.Facts(*facts), checked.device, tuple(values[a.name] for a in self.arguments)

    def fast_check(self) -> FastCheck:
        """The generated one-pass check (its ``source`` shows the text)."""
        return build_fast_check(self.arguments, self.rules, self.derived, self.fact_names, self.cpu_allowed)

    def _result(self, args: tuple[Any, ...]) -> Any:
        positions = self._output_positions
        if len(positions) == 1:
            return args[positions[0]]
        return tuple(args[i] for i in positions)

    def _bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        """Every argument in declared order, defaults filled in (keywords may skip earlier ones)."""
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    # ---- the spec interface the dispatcher and the tuner use ---------------------------------

    def facts(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._bind(args, kwargs)
        return self.check_call(bound)[0]

    def key_for(self, device: DeviceInfo, facts: tuple[Any, ...]) -> Any:
        return self._key(device, self.Facts(*facts))

    def default_config(self, key: Any) -> Any:
        return self._default(key) if self._default is not None else self.space.default()

    def pinned_config(self, values: Mapping[str, Any]) -> Any:
        return self._pin(values) if self._pin is not None else self.space.parse(values)

    def fallback_key(self, key: Any) -> Any:
        return self._fallback_key(key) if self._fallback_key is not None else None

    def serveable(self, config: Any, device: DeviceInfo, facts: tuple[Any, ...]) -> Any:
        return self.serve_with_reason(config, device, facts)[0]

    def serve_with_reason(self, config: Any, device: DeviceInfo, facts: tuple[Any, ...]) -> tuple[Any, str | None]:
        if self._serve is None:
            return config, None
        served = self._serve(config, device, self.Facts(*facts))
        if isinstance(served, Replaced):
            return served.config, served.reason
        return served, None

    def prepare(self, config: Any, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        """The checked launch of ``config`` on these arguments, as a function to call repeatedly.

        The arguments are bound and checked once (an output left out is allocated once); each call
        then costs only the kernel's launch, replayed from the second call on as a plain eager
        call's launches are (:mod:`._replay`).
        """
        bound = self._bind(args, kwargs)
        _, device, bound = self.check_call(bound)
        if device.type == "cpu":
            _prepare_interpreter()
        launch, arguments = self._launch, (config, *bound)
        outputs = [bound[i] for i in self._output_positions]
        result = self._result(bound)
        plans = self._plans

        def run() -> Any:
            # Replayed from its second call on, as a plain eager call's launches are: the tuner's
            # host timings then see what a user's eager call pays.
            if plans is None or self._replayed(plans, config, bound, device) is None:
                run_unwrapped(launch, arguments, outputs)
            return result

        return run

    def launch(self, config: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``config`` on the call's arguments without dispatch, once (checked; see :meth:`prepare`)."""
        return self.prepare(config, *args, **kwargs)()

    def reference(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        inputs = {n: v for n, v in bound.arguments.items() if not isinstance(self._by_name[n], Output)}
        return self._reference(**inputs)

    @property
    def tuning(self) -> KernelTuning:
        """The tuning half, imported on first use (``tuning="module:attribute"``)."""
        if isinstance(self._tuning, str):
            module, _, attribute = self._tuning.partition(":")
            self._tuning = getattr(importlib.import_module(module), attribute)
        if self._tuning is None:
            raise TypeError(f"{self.name}: declared without a tuning half (tuning=...); it cannot be tuned")
        return self._tuning

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        return self.tuning.check(out, expected, problem, config)

    def make_problem(self, key: Any, device: torch.device, seed: int) -> Problem:
        return self.tuning.make_problem(key, device, seed)

    def check_problem(self, key: Any, device: torch.device, seed: int) -> Problem:
        return self.tuning.check_problem(key, device, seed)

    def check_full(self, out: torch.Tensor, portable: torch.Tensor, config: Any) -> str | None:
        return self.tuning.check_full(out, portable, config)

    def starting_configs(self, key: Any, device: DeviceInfo) -> list[Any]:
        return self.tuning.starting_configs(key, device)

    def winner_variants(self, config: Any, key: Any, device: DeviceInfo) -> list[Any]:
        return self.tuning.winner_variants(config, key, device)

    def default_keys(self, device: DeviceInfo, **options: Any) -> list[Any]:
        return self.tuning.default_keys(device)

    def peer(self, key: Any, problem: Problem) -> Peer | None:
        return self.tuning.peer(key, problem)

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace("-", "_").split("_"))


def _default_of(a: Tensor | Obj | Scalar | Output) -> Any:
    if isinstance(a, Output) or (isinstance(a, Tensor) and a.optional):
        return None
    if isinstance(a, Scalar) and (a.optional or a.default is not None):
        return a.default
    return inspect.Parameter.empty


def _empty(args: tuple[Any, ...], outputs: tuple[int, ...]) -> bool:
    """Whether every output has no element (nothing to launch)."""
    # One output without a generator: this runs on every call.
    if len(outputs) == 1:
        return not args[outputs[0]].numel()
    return all(not args[i].numel() for i in outputs)


def _prepare_interpreter() -> None:
    prepare_interpreter()
