"""A server's requests in flight at once: a bounded pool of daemon threads (``bounded``), with a progress bar
(``run_all``). The first failure stops the rest."""

from __future__ import annotations

import queue
import threading


def bounded(job, count: int, workers: int):
    """Run ``job(i, stop)`` for i < ``count`` on at most ``workers`` threads; yield each i as it ends.
    The first exception stops the rest (``stop`` is set: queued jobs never start, retries give up) and
    is raised here. Daemon threads: a request still in flight (up to its timeout) never holds up the
    exit after an error or Ctrl-C, as ``ThreadPoolExecutor``'s joined workers would."""
    stop = threading.Event()
    todo = iter(range(count))
    lock = threading.Lock()
    ended: queue.Queue[tuple[int, BaseException | None]] = queue.Queue()

    def worker() -> None:
        while not stop.is_set():
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                job(i, stop)
                ended.put((i, None))
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread, raised there
                stop.set()
                ended.put((i, err))

    for _ in range(min(workers, count)):
        threading.Thread(target=worker, daemon=True, name="offpolicy-server").start()
    try:
        for _ in range(count):
            i, err = ended.get()
            if err is not None:
                raise err
            yield i
    finally:
        stop.set()


def run_all(job, count: int, workers: int, console, name: str) -> None:
    """``bounded(job, count, workers)`` to the end, with a progress bar on ``console`` (when given)."""
    progress = None
    if console is not None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("server {task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=True)
    try:
        if progress is not None:
            progress.start()
            task = progress.add_task(name, total=count)
        for _ in bounded(job, count, workers):
            if progress is not None:
                progress.advance(task)
    finally:
        if progress is not None:
            progress.stop()
