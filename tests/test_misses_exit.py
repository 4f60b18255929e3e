"""The miss log at exit: a batch the writer thread holds when the process exits is not lost."""

from __future__ import annotations

import threading

from test_misses import logged, miss_log, serve  # noqa: F401

from tritune.configs_db import misses as miss_store


def test_the_exit_waits_for_the_writers_batch_and_writes_what_it_put_back(miss_log, monkeypatch):  # noqa: F811
    serve(300)
    serve(3000)
    write = miss_store.write_misses
    started, release = threading.Event(), threading.Event()

    def locked_once(url, rows, *, timeout_s):
        if not started.is_set():
            started.set()
            release.wait(10)  # another process holds the write lock for a while
            raise miss_store.StoreError("database is locked")
        return write(url, rows, timeout_s=timeout_s)

    monkeypatch.setattr(miss_store, "write_misses", locked_once)
    writer = threading.Thread(target=miss_log.flush)
    miss_log._thread = writer
    writer.start()
    assert started.wait(10)
    assert miss_log.pending() == {}, "the writer holds the whole batch"
    threading.Timer(0.3, release.set).start()
    miss_log._at_exit()
    assert sorted(logged()) == [512, 4096]
