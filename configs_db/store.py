"""The tuner's read-write access to a config DB (:class:`ConfigStore`), and the runtime's read.

The runtime half, :func:`read_winners`, lives in :mod:`configs_db.reader` and is re-exported
here: bounded in time, it never creates, upgrades or writes a file.

The tuner half commits every write on its own (a killed tune loses nothing already measured)
and is safe with several tuner processes on one database: duplicates are absorbed by unique
constraints, and winners are replaced by one conditional upsert, so the best time wins no matter
how offers interleave.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from datetime import timezone
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .errors import StoreError
from .reader import database_error_types, display_url, read_winners, reason_of, winner_records
from .records import TRIAL_STATUSES, EagerAlternative, TrialRow, WinnerRecord
from .values import canonical_json, number_problem, parse_canonical_json, printable, winner_numbers_problem
from .winner_fields import eager_alternative, eager_fields, eager_problem, peer_problem, portable_config_problem

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

    from .models import Environment, Trial
    from .upserts import WinnerValues

__all__ = ["ConfigStore", "StoreError", "TrialRow", "display_url", "read_winners"]

log = logging.getLogger("tritune.configs_db")

#: Failure messages beyond this are cut: a compiler dump says nothing more after 8 KB.
MAX_ERROR_CHARS = 8000


def eager_json(eager: EagerAlternative) -> str:
    """``winners.eager_json`` for a checked alternative: its JSON form with sorted keys, no spaces, ASCII."""
    return json.dumps(eager_fields(eager), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _trial_row(trial: Trial) -> TrialRow | None:
    try:
        key = parse_canonical_json(trial.key_json)
        config = parse_canonical_json(trial.config_json)
    except ValueError as exc:
        log.warning("skipping trials row %d (%s): %s", trial.id, printable(trial.kernel), printable(str(exc)))
        return None
    return TrialRow(
        environment_id=trial.environment_id,
        kernel=trial.kernel,
        kernel_version=trial.kernel_version,
        key=key,
        config=config,
        status=trial.status,
        time_ms=trial.time_ms,
        error=trial.error,
        # SQLite hands back naive datetimes; they were written in UTC.
        created_at=trial.created_at if trial.created_at.tzinfo else trial.created_at.replace(tzinfo=timezone.utc),
    )


class ConfigStore:
    """Read-write access to a config DB for the tuner; the schema is upgraded to head on open.

    Every method runs in its own committed transaction. Use it as a context manager (or call
    :meth:`close`) to release the database's connections.
    """

    def __init__(self, url: str, *, timeout_s: float | None = None) -> None:
        """``timeout_s``: how long a statement waits for a lock held by another writer (default: a tuner's patience)."""
        from . import storage

        self.url = url
        self.source = f"db:{display_url(url)}"
        self._engine: Engine = storage.make_engine(url, timeout_s=timeout_s)
        try:
            storage.upgrade(self._engine)
        except database_error_types() as exc:
            self._engine.dispose()
            raise StoreError(f"cannot open {display_url(url)} as a config DB: {reason_of(exc)}") from exc
        except BaseException:
            self._engine.dispose()
            raise

    @property
    def engine(self) -> Engine:
        return self._engine

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> ConfigStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _session(self) -> AbstractContextManager[Session]:
        from .storage import session_scope

        return session_scope(self._engine)

    # ---- environments -----------------------------------------------------------------------

    def environment(
        self,
        *,
        gpu: str,
        torch_version: str,
        triton_version: str,
        tritune_version: str,
        gpu_name: str = "",
        capability: str = "",
        sm_count: int = 0,
        driver: str = "",
        cuda: str = "",
    ) -> int:
        """The id of the environment with these values, created if new."""
        from .models import Environment

        with self._session() as session:
            row = Environment.get_or_create(
                session,
                gpu=gpu,
                gpu_name=gpu_name,
                capability=capability,
                sm_count=sm_count,
                driver=driver,
                cuda=cuda,
                torch_version=torch_version,
                triton_version=triton_version,
                tritune_version=tritune_version,
            )
            session.flush()
            return int(row.id)

    # ---- trials -------------------------------------------------------------------------------

    def record_trial(
        self,
        env_id: int,
        kernel: str,
        kernel_version: str,
        key: dict[str, Any],
        config: dict[str, Any],
        status: str,
        time_ms: float | None = None,
        error: str | None = None,
    ) -> bool:
        """Store one measurement; ``False`` (and nothing written) if that trial is already stored.

        A duplicate is absorbed by the unique constraint, not checked beforehand, so two tuner
        processes measuring the same config at once store it exactly once.
        """
        if status not in TRIAL_STATUSES:
            raise ValueError(f"trial status {status!r}: expected one of {', '.join(TRIAL_STATUSES)}")
        if status == "ok" and time_ms is None:
            raise ValueError("an 'ok' trial needs its time_ms")
        if time_ms is not None:
            problem = number_problem(time_ms, "time_ms")
            if problem is not None:
                raise ValueError(f"trial of {kernel}: {problem}")
        if error is not None and len(error) > MAX_ERROR_CHARS:
            error = error[:MAX_ERROR_CHARS] + "\n[... truncated]"
        from . import upserts
        from .models import utcnow

        values = {
            "environment_id": env_id,
            "kernel": kernel,
            "kernel_version": kernel_version,
            "key_json": canonical_json(key),
            "config_json": canonical_json(config),
            "status": status,
            "time_ms": None if time_ms is None else float(time_ms),
            "error": error,
            "created_at": utcnow(),
        }
        with self._session() as session:
            return upserts.insert_trial(session, values)

    def measured_trials(self, env_id: int, kernel: str, kernel_version: str, key: dict[str, Any]) -> list[TrialRow]:
        """Every trial stored at one key, oldest first (to resume a tune without re-measuring)."""
        from .models import Trial

        with self._session() as session:
            trials = Trial.for_key(session, env_id, kernel, kernel_version, canonical_json(key))
            return [row for row in map(_trial_row, trials) if row is not None]

    def study_trials(self, env_id: int, kernel: str, kernel_version: str) -> list[TrialRow]:
        """Every trial of one kernel version in one environment, grouped by key."""
        from .models import Trial

        with self._session() as session:
            trials = Trial.for_study(session, env_id, kernel, kernel_version)
            return [row for row in map(_trial_row, trials) if row is not None]

    # ---- winners ------------------------------------------------------------------------------

    def offer_winner(self, record: WinnerRecord, env_id: int, refresh_eager: bool = False) -> bool:
        """Store ``record`` as the winner at its key unless a better one is stored; ``True`` if written.

        The stored winner is replaced when the offer is faster, or when the stored one was
        measured under another Triton version or against another portable default than the
        offer's (the runtime does not serve those as current, so they must not block a fresh
        measurement). One conditional upsert decides, so concurrent offers leave
        exactly one row holding the best time. The record's peer time and name and its eager
        alternative travel with it: they are stored when the offer is (``None`` clears what the
        replaced winner had), and left as they are when it is not.

        ``refresh_eager``: where the store keeps its winner and that is ``record``'s config, the
        kept winner takes ``record``'s eager alternative (``None`` clears it), in the same
        transaction. The tuner asks for it when it measured that very config again, and its eager
        calls as this tritune runs them (replayed): the stored alternative may date from another
        way of running them. The stored time, the faster one, stays.
        """
        with self._session() as session:
            return self._offer(session, record, env_id, refresh_eager=refresh_eager)

    def _offer(
        self,
        session: Session,
        record: WinnerRecord,
        env_id: int,
        current: tuple[str, str] | None = None,
        refresh_eager: bool = False,
        measured_here: bool = True,
    ) -> bool:
        """:meth:`offer_winner` inside the caller's transaction; ``ValueError`` before anything is written.

        ``current``: the (Triton, torch) versions under which a stored winner counts as current
        (not replaced unless the offer is faster); default the offer's own, as a tune's offers are.
        ``measured_here``: see :func:`.upserts.offer_winner` (an import's records are not).
        """
        from . import upserts

        values, environment = self._values(session, record, env_id)
        triton_version, torch_version = current or (environment.triton_version, environment.torch_version)
        stored = upserts.offer_winner(session, values, triton_version, torch_version, measured_here=measured_here)
        if not stored and refresh_eager:
            upserts.refresh_eager(session, values)
        return stored

    def _values(self, session: Session, record: WinnerRecord, env_id: int) -> tuple[WinnerValues, Environment]:
        """``record`` checked and in column form, and its environment row; ``ValueError`` if it is
        inconsistent or its environment unknown."""
        problem = winner_numbers_problem(record.time_ms, record.portable_ms, record.speedup, record.trials)
        problem = problem or peer_problem(record.peer_ms, record.peer_name)
        problem = problem or eager_problem(None if record.eager is None else eager_fields(record.eager))
        problem = problem or portable_config_problem(record.portable_config)
        if problem is not None:
            raise ValueError(f"winner for {record.kernel}: {problem}")
        eager = None if record.eager is None else eager_alternative(eager_fields(record.eager))
        from . import upserts
        from .models import Environment

        environment = session.get(Environment, env_id)
        if environment is None:
            raise ValueError(f"unknown environment id {env_id}")
        mismatch = _provenance_mismatch(record, environment)
        if mismatch:
            raise ValueError(f"winner for {record.kernel} does not match environment {env_id}: {mismatch}")
        values = upserts.WinnerValues(
            gpu=record.gpu,
            kernel=record.kernel,
            kernel_version=record.kernel_version,
            key_json=canonical_json(record.key),
            config_json=canonical_json(record.config),
            time_ms=float(record.time_ms),
            portable_ms=float(record.portable_ms),
            speedup=float(record.speedup),
            trial_count=int(record.trials),
            environment_id=env_id,
            peer_ms=None if record.peer_ms is None else float(record.peer_ms),
            peer_name=record.peer_name,
            eager_json=None if eager is None else eager_json(eager),
            portable_config_json=None if record.portable_config is None else canonical_json(record.portable_config),
        )
        return values, environment

    def winners(self, gpu: str | None = None, kernel: str | None = None) -> list[WinnerRecord]:
        """Stored winners, optionally of one GPU and/or kernel."""
        with self._session() as session:
            return winner_records(session, gpu, kernel, self.source)

    def import_records(
        self, records: Iterable[WinnerRecord], current: tuple[str, str] | None = None
    ) -> tuple[int, int]:
        """Offer each record (e.g. from a bundle) as a winner; ``(imported, skipped)``.

        ``current`` names the running (Triton, torch) versions: a stored winner measured under
        them is then only replaced by a faster record, however old the bundle's own versions are.

        Each record's environment is rebuilt from its provenance (``extra`` supplies the GPU
        name, capability, SM count, driver and CUDA where known). Skipped are records that are
        not better than what is stored, and records with absurd numbers (logged). All records go
        in one transaction: an import that fails part-way (a full disk, a lock) writes nothing.
        """
        from .models import Environment

        imported = skipped = 0
        with self._session() as session:
            for record in records:
                extra = record.extra
                environment = Environment.get_or_create(
                    session,
                    gpu=record.gpu,
                    torch_version=record.torch_version,
                    triton_version=record.triton_version,
                    tritune_version=record.tritune_version,
                    gpu_name=str(extra.get("gpu_name", "")),
                    capability=str(extra.get("capability", "")),
                    sm_count=int(extra.get("sm_count", 0)),
                    driver=str(extra.get("driver", "")),
                    cuda=str(extra.get("cuda", "")),
                )
                session.flush()
                try:
                    written = self._offer(session, record, int(environment.id), current, measured_here=False)
                except ValueError as exc:
                    log.warning(
                        "not importing %s %s: %s",
                        printable(record.source),
                        printable(record.kernel),
                        printable(str(exc)),
                    )
                    written = False
                if written:
                    imported += 1
                else:
                    skipped += 1
        return imported, skipped


def _provenance_mismatch(record: WinnerRecord, environment: Environment) -> str:
    pairs = (
        ("gpu", record.gpu, environment.gpu),
        ("triton_version", record.triton_version, environment.triton_version),
        ("torch_version", record.torch_version, environment.torch_version),
        ("tritune_version", record.tritune_version, environment.tritune_version),
    )
    return ", ".join(f"{name} {mine!r} != {theirs!r}" for name, mine, theirs in pairs if mine != theirs)
