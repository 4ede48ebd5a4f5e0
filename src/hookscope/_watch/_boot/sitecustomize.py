"""The start-up hook of ``hookscope watch``, imported by Python in every process of the command.

``hookscope watch`` puts this file's directory first on the command's ``PYTHONPATH`` and its
settings in ``HOOKSCOPE_WATCH``. Python imports ``sitecustomize`` at start-up, so every Python
process of the command runs this module. It must cost nothing where nothing trains (the
``torchrun`` launcher, DataLoader workers, tools the script calls), so it imports nothing and
does three small things:

1. If ``HOOKSCOPE_WATCH`` is set, a finder on ``sys.meta_path`` waits for ``torch`` to be
   imported, then wraps ``torch.optim.Optimizer.__init__`` (once, chained: subclasses and
   optimizers wrapping others pass through it too) and ``torch.autograd.backward``
   (``Tensor.backward`` calls it), and registers one global optimizer step pre-hook: three
   trampolines. The first optimizer created in the process imports
   ``hookscope._watch._agent``, which finds the model and attaches a Monitor before the
   model's first forward; the step hook ends each step, and finds the models of optimizers
   created before the wrapper was in place. The first ``backward()`` of the process imports
   it too, to find the models trained without an optimizer (plain SGD by hand); later ones
   pass straight through. A process that never creates an optimizer nor runs a backward
   pass never imports hookscope, prints nothing and writes nothing.
2. It imports the ``sitecustomize`` it shadows (the user's, or the system's), as
   ``ddtrace-run`` does: our directory leaves ``sys.path`` for that import only.
3. Its directory stays on ``PYTHONPATH``, so ``torchrun`` and ``spawn`` workers run it too.

The trampolines are installed in torch directly rather than through ``_hooks.HookSet``:
importing hookscope would cost every process that imports torch a few hundred milliseconds.
"""

import os
import sys

_ENV = "HOOKSCOPE_WATCH"
_agent = None  # hookscope._watch._agent.Agent, once an optimizer was made in this process
_backward_seen = False  # the process's first backward() was handed to the agent
_broken = False  # hookscope could not be imported here: say so once, then stay out of the way


class _AfterTorch:
    """A meta path finder that lets every other finder find ``torch``, then wraps its loader
    so that ``_install`` runs once torch has been imported completely."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = getattr(spec.loader, "exec_module", None)
        if exec_module is not None:

            def exec_then_install(module):
                exec_module(module)
                _leave_meta_path()
                _install()

            spec.loader.exec_module = exec_then_install
        return spec


def _leave_meta_path():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterTorch)]


def _install():
    try:
        from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook
    except Exception as exc:  # a torch without global optimizer hooks (before 2.0)
        sys.stderr.write(f"hookscope watch: this torch has no global optimizer hooks ({exc})\n")
        return
    _wrap_init(Optimizer)
    register_optimizer_step_pre_hook(_on_step)
    _wrap_backward()


def _wrap_init(cls):
    """``cls.__init__`` followed by ``_on_created``; the optimizer is built whatever we do."""
    init = cls.__init__
    if getattr(init, "_hookscope_watch", False):
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        agent = _get_agent()
        if agent is not None:
            try:
                agent.created(self)
            except Exception as exc:  # never break the user's training
                sys.stderr.write(f"hookscope watch: {type(exc).__name__}: {exc}. Not watching.\n")

    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(__init__, name, getattr(init, name, None))
    __init__.__wrapped__ = init  # inspect.signature() reads the original's
    __init__._hookscope_watch = True
    cls.__init__ = __init__


def _wrap_backward():
    """``torch.autograd.backward`` that hands the process's first backward pass, once it
    has run (the gradients are there), to the agent; every later call passes straight
    through. Hookscope's own wrapper of it (``_monitor/_calls.py``) wraps this one."""
    import torch.autograd

    original = torch.autograd.backward
    if getattr(original, "_hookscope_watch", False):
        return

    def backward(tensors, *args, **kwargs):
        global _backward_seen
        result = original(tensors, *args, **kwargs)
        if not _backward_seen:
            _backward_seen = True
            agent = _get_agent()
            if agent is not None:
                agent.first_backward(tensors)
        return result

    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(backward, name, getattr(original, name, None))
    backward.__wrapped__ = original
    backward._hookscope_watch = True
    torch.autograd.backward = backward


def _on_step(optimizer, args, kwargs):
    """Every ``optimizer.step()`` of the process passes here first."""
    agent = _get_agent()
    if agent is not None:
        agent.before_step(optimizer)
    return None


def _get_agent():
    """The process's agent, made (importing hookscope) the first time; ``None`` if it cannot."""
    global _agent, _broken
    if _agent is None and not _broken:
        try:
            from hookscope._watch._agent import Agent
        except ImportError as exc:
            _broken = True
            sys.stderr.write(
                f"hookscope watch: cannot import hookscope in {sys.executable} ({exc}); "
                "install hookscope in the environment that runs the script. Not watching.\n"
            )
            return None
        try:
            _agent = Agent.from_env(os.environ.get(_ENV, ""))
        except Exception as exc:  # never break the user's training
            _broken = True
            sys.stderr.write(f"hookscope watch: bad {_ENV} ({exc!r}). Not watching.\n")
    return _agent


def _same(a, b):
    return os.path.realpath(a or ".") == b


def _chain():
    """Import the ``sitecustomize`` that this one shadows, with our directory off
    ``sys.path`` for that import only; keep this module importable as ``_hookscope_boot``."""
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    ours = [i for i, p in enumerate(sys.path) if _same(p, here)]
    if not ours:
        return
    entry, me = sys.path[ours[0]], sys.modules.pop("sitecustomize", None)
    sys.modules["_hookscope_boot"] = me
    sys.path[:] = [p for p in sys.path if not _same(p, here)]
    try:
        import sitecustomize  # noqa: F401  (the next one on sys.path, if any)
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise  # its own error: site.py reports it, as it would without hookscope
    finally:
        sys.path.insert(min(ours[0], len(sys.path)), entry)
        if "sitecustomize" not in sys.modules:
            sys.modules["sitecustomize"] = me


def _main():
    if os.environ.get(_ENV):
        if "torch" in sys.modules:  # imported by a .pth file before us
            _install()
        else:
            sys.meta_path.insert(0, _AfterTorch())
    _chain()


if __name__ == "sitecustomize":
    _main()
