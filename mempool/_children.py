"""The default pools in the child processes of multiprocessing's "spawn" and "forkserver".

:func:`mempool.run.install_default` (``python -m mempool run``, ``import mempool.auto``)
calls :func:`propagate` once the pools are in.

A child started by "spawn" or "forkserver" is a fresh interpreter (or a fork of one) that
rebuilds the parent's arguments, CUDA tensors among them, before its target runs: the tensor's
IPC handle is opened by whatever allocator PyTorch has at that moment, and a pool's handle
opens only on a pool. So the child installs the same pools before anything is unpickled:

- spawn: the parent wraps ``multiprocessing.spawn.get_command_line``; the child's ``-c``
  program calls :func:`install_in_child` before ``spawn_main`` reads the pipe.
- forkserver: the server forks every child, so it must hold no pool and no CUDA context (each
  fork would inherit them, and a pool refuses in a forked child). The parent adds this module
  to the server's preload list (``ForkServer.ensure_running``, wrapped, so a user's
  ``set_forkserver_preload`` keeps it); imported in the server, it only registers an
  ``os.register_at_fork`` hook that installs in each forked child before ``_serve_one``
  reads the pipe. An ``install_default`` reached in the server itself (``import
  mempool.auto`` at the top of a script the server preloads as ``__mp_main__``) makes nothing.
- fork: the child inherits the installed allocator; a pool refuses in a forked child.

What the child installs travels in the environment: the settings in ``MEMPOOL_CONF``
(``install_default`` writes them there), the frameworks to hook in ``HOOKS_VAR``, set by the
parent only while children are on (``MEMPOOL_CHILDREN``, read once in the parent). A child
says nothing unless ``MEMPOOL_CHILDREN=verbose``, except that the install failed; it never
raises, since an exception there would end the child before its target with a traceback
about mempool.
"""
import os
import sys
import types
import warnings

__all__ = ["CHILDREN_VAR", "HOOKS_VAR", "mode", "propagate", "install_in_child",
           "in_forkserver", "quiet"]

#: The user's switch: "0" (the default) leaves children alone, "1" installs, "verbose" also
#: prints one line per child. Off by default: a child installs its pools at its start, so
#: every spawn child (DataLoader workers, one process per GPU under torch.multiprocessing.spawn)
#: would hold a CUDA context on every device, where PyTorch's allocator makes one on first use.
CHILDREN_VAR = "MEMPOOL_CHILDREN"
#: Set by a parent whose children install: the frameworks to hook ("torch,cupy", "none").
HOOKS_VAR = "_MEMPOOL_CHILD_HOOKS"

_MODES = {"": "off", "1": "on", "0": "off", "verbose": "verbose"}

_hooked_multiprocessing = False   # this process's spawn and forkserver are wrapped
_installed_as = None              # "spawn" or "forkserver": this child installed from its parent
_fork_hook = False                # the forkserver's at-fork hook is registered in this process
_forked = False                   # this process is a child the forkserver forked


def mode() -> str:
    """``"on"``, ``"off"`` or ``"verbose"``, from ``MEMPOOL_CHILDREN``; ValueError when set to
    anything else."""
    raw = os.environ.get(CHILDREN_VAR, "")
    found = _MODES.get(raw.strip().lower())
    if found is None:
        raise ValueError(
            f"environment variable {CHILDREN_VAR}: {raw!r} is not a setting; accepted: 0 "
            "(child processes keep PyTorch's allocator; the default), 1 (spawn and forkserver "
            "children install the same pools), verbose (and each says so on stderr)")
    return found


def propagate(torch: bool, cupy: bool) -> None:
    """Make this process's spawn and forkserver children install the same default pools,
    hooking `torch` and `cupy` as this process did; called by install_default with
    children on."""
    hooks = [name for name, wanted in (("torch", torch), ("cupy", cupy)) if wanted]
    os.environ[HOOKS_VAR] = ",".join(hooks) or "none"
    _hook_multiprocessing()


def withdraw() -> None:
    """Children off: none of this process's children (or theirs) install from it."""
    os.environ.pop(HOOKS_VAR, None)


def quiet() -> bool:
    """Whether this process's own line about the pools stays unsaid, unless
    ``MEMPOOL_CHILDREN=verbose``: in the forkserver process, and in a multiprocessing child of
    a parent whose children install (one that did, or that imports ``mempool.auto`` again,
    where mempool was not importable before it unpickled)."""
    if os.environ.get(CHILDREN_VAR, "").strip().lower() == "verbose":
        return False
    return (_installed_as is not None or in_forkserver()
            or (HOOKS_VAR in os.environ and _in_multiprocessing_child()))


def _in_multiprocessing_child():
    process = sys.modules.get("multiprocessing.process")
    if process is None:
        return False
    # _inheriting: still rebuilding what the parent sent (the main module among it).
    return (process.parent_process() is not None
            or getattr(process.current_process(), "_inheriting", False))


# --------------------------------------------------------------------------- the parent


def _hook_multiprocessing():
    global _hooked_multiprocessing
    if _hooked_multiprocessing:
        return
    from multiprocessing import spawn
    spawn.get_command_line = _spawn_command_line(spawn.get_command_line)
    try:
        from multiprocessing import forkserver
    except ImportError:          # a platform without it
        pass
    else:
        server = forkserver._forkserver
        server.ensure_running = _ensure_running(server, server.ensure_running)
    _hooked_multiprocessing = True


# The child's -c program runs this before spawn_main. mempool is looked for where the parent
# found it as well, the child's sys.path being the interpreter's default until spawn_main
# restores the parent's.
_PROLOGUE = """\
import sys
_mempool_path = {path!r} not in sys.path and {path!r}
if _mempool_path:
    sys.path.append(_mempool_path)
try:
    from mempool._children import install_in_child as _mempool_install
except Exception:
    _mempool_install = None
finally:
    if _mempool_path:
        sys.path.remove(_mempool_path)
if _mempool_install is not None:
    _mempool_install()
del _mempool_path, _mempool_install
"""


def _package_root():
    import mempool
    return os.path.dirname(os.path.dirname(os.path.abspath(mempool.__file__)))


def _spawn_command_line(original):
    def get_command_line(**kwds):
        cmd = original(**kwds)
        # A frozen executable has no -c program: it is left as it is.
        if HOOKS_VAR in os.environ and "-c" in cmd:
            i = cmd.index("-c") + 1
            cmd = [*cmd[:i], _PROLOGUE.format(path=_package_root()) + cmd[i], *cmd[i + 1:]]
        return cmd
    get_command_line.__wrapped__ = original
    get_command_line.__doc__ = original.__doc__
    return get_command_line


def _ensure_running(server, original):
    def ensure_running():
        if HOOKS_VAR in os.environ and __name__ not in server._preload_modules:
            # A new list: set_forkserver_preload's argument stays the caller's.
            server._preload_modules = [*server._preload_modules, __name__]
        return original()
    ensure_running.__wrapped__ = original
    ensure_running.__doc__ = original.__doc__
    return ensure_running


# --------------------------------------------------------------------------- the child


def install_in_child() -> None:
    """The spawn child's install, before ``spawn_main``; never raises."""
    _install_here("spawn")


def _install_here(how):
    global _installed_as
    hooks = os.environ.get(HOOKS_VAR)
    try:
        setting = mode()
    except ValueError:           # the parent read it when it installed; it changed since
        setting = "on"
    if hooks is None or setting == "off":
        return
    try:
        from mempool import run
        with warnings.catch_warnings():
            if setting != "verbose":
                # The parent said each warning once; every child would repeat it.
                warnings.simplefilter("ignore")
            installed = run.install_default(torch="torch" in hooks.split(","),
                                            cupy="cupy" in hooks.split(","))
    except Exception as exc:
        _say(how, f"could not install the pool, so this child keeps the frameworks' own "
                  f"allocators: {type(exc).__name__}: {exc}")
        return
    _installed_as = how
    if setting == "verbose":
        _say(how, installed.describe())


def _say(how, text):
    try:
        print(f"mempool: {how} child process {os.getpid()}: {text}", file=sys.stderr,
              flush=True)
    except Exception:            # no stderr in this child: nothing to say it on
        pass


# --------------------------------------------------------------------------- the forkserver


def in_forkserver() -> bool:
    """Whether this is multiprocessing's forkserver process (not a child it forked)."""
    if _forked:
        return False
    forkserver = sys.modules.get("multiprocessing.forkserver")
    if forkserver is None:
        return False
    serving = getattr(getattr(forkserver, "main", None), "__code__", None)
    serve_one = getattr(getattr(forkserver, "_serve_one", None), "__code__", None)
    if serving is None:
        return False
    found = False
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is serve_one:
            return False
        found = found or frame.f_code is serving
        frame = frame.f_back
    return found


def serve_forks() -> None:
    """In the forkserver process: each child it forks installs the pools first."""
    global _fork_hook
    if not _fork_hook:
        os.register_at_fork(after_in_child=_after_fork)
        _fork_hook = True


def _after_fork():
    global _forked
    _forked = True
    _install_here("forkserver")


# Preloaded by the forkserver (see _ensure_running): register the hook there, and only there.
if in_forkserver():
    serve_forks()
