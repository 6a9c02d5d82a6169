"""Whom a worker's death is charged to.

Each job may run on at most `migration_limit` workers that die (BrokerConfig): a job that kills every
worker it lands on (a poison prompt, an out-of-memory prefill) must not migrate forever. But its
neighbours on the worker it killed did nothing wrong, and charging them too made one bad job fail
innocent ones once their budgets ran out. Evidence of innocence is output: a job that delivered tokens
on the worker since its dispatch there was running fine on it. So a death is charged to the jobs that
delivered nothing there; when every job there was delivering, none can be told from the culprit and all
are charged. Every migration, charged or not, also counts toward a hard bound (2 x migration_limit), so
nothing migrates without end.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.broker.jobs import Job


def charged(jobs: Sequence[Job]) -> set[str]:
    """The ids of the jobs (those that were running on a worker that died) that its death is charged to."""
    silent = {j.job_id for j in jobs if j.num_tokens == j.dispatched_tokens}
    return silent or {j.job_id for j in jobs}


def migration_refusal(job: Job, migration_limit: int) -> str | None:
    """Why `job` may not migrate again (after one more failure was or was not charged to it), or None."""
    if job.failures >= migration_limit:
        return f"job was running on {job.failures} workers that died (migration limit)"
    if job.attempt + 1 > 2 * migration_limit:
        return f"job migrated {job.attempt} times (bound: twice the migration limit)"
    return None
