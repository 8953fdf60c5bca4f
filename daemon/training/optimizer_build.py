"""The inner optimizer, made once on a side thread as soon as the trainer exists.

torch imports its compiler stack (seconds of CPU) at the first optimizer a process makes: made
from the start, it is off the path of a joiner's DHT start and download. (Started only when the
download begins, it slowed the transfer instead, and the joiner trained about a second later:
measured on a busy 2-core host.)
"""

from __future__ import annotations

import concurrent.futures
import threading

import torch

from dtnode.daemon.training.inner_optimizer import InnerOptimizerKind, build_inner_optimizer


class OptimizerBuild:
    """One inner optimizer, built on a thread of its own the first time anyone asks; whoever
    needs it waits for the result, and a failure to build it is raised to them."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, kind: InnerOptimizerKind):
        self._args = (model, lr, weight_decay, kind)
        self._future: concurrent.futures.Future[torch.optim.Optimizer] = concurrent.futures.Future()
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> concurrent.futures.Future[torch.optim.Optimizer]:
        """Start building (once); the future of the optimizer.

        Not a daemon thread: the interpreter's exit waits for it. A node that stopped in its
        first seconds (a joiner refused for another recipe) exited while the thread was still
        importing torch's compiler stack, whose modules register `weakref.finalize` hooks, and
        the exit's walk over those hooks raised `dictionary changed size during iteration`."""
        with self._lock:
            if not self._started:
                self._started = True
                threading.Thread(target=self._build, name="inner-optimizer").start()
        return self._future

    def result(self) -> torch.optim.Optimizer:
        return self.start().result()

    @property
    def built(self) -> bool:
        return self._future.done()

    def _build(self) -> None:
        try:
            self._future.set_result(build_inner_optimizer(*self._args))
        except BaseException as e:  # noqa: BLE001  (raised to whoever first needs the optimizer)
            self._future.set_exception(e)
