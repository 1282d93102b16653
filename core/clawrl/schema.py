"""The one owner of the run store's SQLite schema and its migrations.

Every table in ``run_dir/clawrl.sqlite`` is declared here, as a ``TableSet``: the turn store's own
tables, the rollout buffer's, OPD's and the environments' episodes. Each set has
its own version, so the modules that use the tables migrate apart from each other: a store opened by
``clawrl sessions`` holds the turns' tables; the buffer and the OPD method bring their sets up to date
when they open the store (``TurnStore.register``). A set only ever grows: index i of ``migrations``
upgrades version i to i + 1, and a store newer than this clawrl is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TableSet:
    what: str  # named in logs and errors: "turn store", "rollout buffer", "OPD"
    meta_key: Optional[str]  # where its version is kept in table ``meta``; None: PRAGMA user_version
    migrations: tuple[str, ...]  # ';'-separated statement blocks


TURNS = TableSet("turn store", None, (
    # version 1
    """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE sessions (
    session_id   TEXT PRIMARY KEY,
    caller_hash  TEXT NOT NULL,
    user         TEXT,
    source       TEXT NOT NULL,          -- header | inferred
    created_at   REAL NOT NULL,
    last_seen_at REAL NOT NULL
);
CREATE TABLE branches (
    session_id      TEXT NOT NULL REFERENCES sessions(session_id),
    branch_id       INTEGER NOT NULL,
    parent_turn_id  INTEGER,             -- the turn this branch continues from (NULL: the session start)
    sibling_turn_id INTEGER,             -- the turn this branch is an alternative to
    created_at      REAL NOT NULL,
    PRIMARY KEY (session_id, branch_id)
);
CREATE TABLE turns (
    turn_id          INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id       TEXT NOT NULL REFERENCES sessions(session_id),
    branch_id        INTEGER NOT NULL,
    parent_turn_id   INTEGER,
    turn_index       INTEGER NOT NULL,
    caller_hash      TEXT NOT NULL,
    link_rule        TEXT NOT NULL,
    turn_type        TEXT NOT NULL CHECK (turn_type IN ('main', 'side')),
    type_rule        TEXT NOT NULL,
    status           TEXT NOT NULL CHECK (status IN ('complete', 'aborted', 'error')),
    trainable        INTEGER NOT NULL,
    untrainable_reason TEXT,
    messages         TEXT NOT NULL,
    history_len      INTEGER NOT NULL,
    tools            TEXT,
    prompt_ids       BLOB,
    response_ids     BLOB,
    logprobs         BLOB,
    weight_versions  BLOB,
    prompt_tokens    INTEGER NOT NULL,
    response_tokens  INTEGER NOT NULL,
    response_text    TEXT NOT NULL,
    tool_calls       TEXT,
    tool_parse_error TEXT,
    finish_reason    TEXT,
    next_state       TEXT,
    close_reason     TEXT,
    created_at       REAL NOT NULL,
    completed_at     REAL NOT NULL,
    next_state_at    REAL,
    request_key      TEXT NOT NULL,
    reply_key        TEXT
);
CREATE INDEX turns_by_session ON turns (session_id, turn_id);
CREATE INDEX turns_by_request_key ON turns (request_key);
CREATE INDEX turns_by_reply_key ON turns (reply_key) WHERE reply_key IS NOT NULL;
CREATE INDEX open_turns ON turns (session_id) WHERE close_reason IS NULL;
CREATE TABLE corrections (
    correction_id INTEGER PRIMARY KEY AUTOINCREMENT,
    turn_id       INTEGER NOT NULL REFERENCES turns(turn_id),
    old_label     TEXT NOT NULL,
    new_label     TEXT NOT NULL,
    actor         TEXT NOT NULL,
    at            REAL NOT NULL
);
""",
    # version 2: the temperature the turn's logprobs were taken at, so the trainer recomputes them alike
    "ALTER TABLE turns ADD COLUMN temperature REAL NOT NULL DEFAULT 1.0",
    # version 3: content-addressed blobs (issue 20). Every request re-sends the whole conversation,
    # an OpenClaw one with a 40 KB system prompt and 10 KB of tools, so each message, the tools list
    # and each 256-token chunk of the prompt ids is stored once and a turn lists the blobs it is made
    # of: message_blobs (JSON list of blob ids, in message order), tools_blob, prompt_blobs (JSON list
    # of the blob ids of the prompt's token chunks). Turns written before keep their inline messages,
    # tools and prompt_ids (the three new columns NULL) and are read as they are. A new turn's messages
    # column holds '' and its tools and prompt_ids columns NULL (clawrl.store reassembles all three).
    # (No comment may end an ALTER TABLE line: SQLite appends it to the table's stored CREATE text.)
    """
CREATE TABLE blobs (
    blob_id INTEGER PRIMARY KEY,
    digest  BLOB NOT NULL UNIQUE,        -- sha256 of the kind and the body
    kind    TEXT NOT NULL CHECK (kind IN ('message', 'tools', 'ids')),
    body    NOT NULL                     -- message, tools: JSON text. ids: packed int32 token ids
);
ALTER TABLE turns ADD COLUMN message_blobs TEXT;
ALTER TABLE turns ADD COLUMN tools_blob INTEGER REFERENCES blobs(blob_id);
ALTER TABLE turns ADD COLUMN prompt_blobs TEXT
""",
))

BUFFER = TableSet("rollout buffer", "buffer_schema_version", (
    # version 1
    """
    CREATE TABLE samples (
        sample_id       INTEGER PRIMARY KEY AUTOINCREMENT,
        turn_id         INTEGER NOT NULL UNIQUE REFERENCES turns(turn_id),
        group_id        TEXT NOT NULL,       -- hash of the prompt ids: samples of one prompt form a GRPO group
        request_key     TEXT NOT NULL,       -- the turn's request key: its sibling choices share it
        state           TEXT NOT NULL CHECK (state IN ('pending','judged','ready','consumed','trained','skipped')),
        skip_reason     TEXT,
        judge_kind      TEXT,
        verdict         INTEGER,             -- the judge's majority score (also for no_signal)
        reward          REAL,
        advantage       REAL,
        weight_lag      INTEGER,             -- at take time: current version - oldest token's version
        consumed_version INTEGER,
        train_step      INTEGER,
        trained_version INTEGER,
        requeues        INTEGER NOT NULL DEFAULT 0,
        created_at      REAL NOT NULL,
        judged_at       REAL,
        consumed_at     REAL,
        done_at         REAL                 -- trained or skipped
    );
    CREATE INDEX samples_by_state ON samples (state, sample_id);
    CREATE INDEX samples_by_group ON samples (group_id, state);
    CREATE TABLE votes (
        vote_id    INTEGER PRIMARY KEY AUTOINCREMENT,
        sample_id  INTEGER NOT NULL REFERENCES samples(sample_id),
        attempt    INTEGER NOT NULL,         -- 1 + the retry it came from
        vote_index INTEGER NOT NULL,
        judge_kind TEXT NOT NULL,
        score      INTEGER,                  -- NULL: garbage, timeout or error (see rationale)
        rationale  TEXT NOT NULL,
        raw        TEXT NOT NULL,
        at         REAL NOT NULL
    );
    CREATE INDEX votes_by_sample ON votes (sample_id);
    """,
    # version 2: on-policy distillation
    """
    ALTER TABLE samples ADD COLUMN rl_signal INTEGER NOT NULL DEFAULT 1;  -- 0: no judged reward (OPD only)
    ALTER TABLE samples ADD COLUMN opd_state TEXT;                         -- NULL (unresolved), scored, none, timeout
    """,
    # version 3: weights re-served under a new version after a restart (clawrl.weight_lineage)
    """
    CREATE TABLE weight_aliases (
        version INTEGER PRIMARY KEY,         -- the new version number
        source  INTEGER NOT NULL,            -- the version whose weights it serves again
        at      REAL NOT NULL
    );
    """,
    # version 4: a sample points to its source as (source, source_id): a served turn, an episode
    # (env.sample_mode=trajectory) or one step of an episode (per_turn). SQLite cannot drop NOT NULL
    # from turn_id, so the table is rebuilt; votes keep referring to it (their check is deferred to
    # the commit, by which time every sample is back under its id).
    """
    PRAGMA defer_foreign_keys = ON;
    CREATE TEMP TABLE samples_v3 AS SELECT * FROM samples;
    DROP TABLE samples;
    CREATE TABLE samples (
        sample_id       INTEGER PRIMARY KEY AUTOINCREMENT,
        source          TEXT NOT NULL CHECK (source IN ('turn', 'episode', 'step')),
        source_id       INTEGER NOT NULL,    -- turns.turn_id, episodes.episode_id or episode_steps.step_id
        turn_id         INTEGER UNIQUE REFERENCES turns(turn_id),  -- source = turn only
        group_id        TEXT NOT NULL,       -- GRPO group: a prompt's hash (turns), a task and round (episodes)
        request_key     TEXT,                -- the turn's request key (its sibling choices share it)
        state           TEXT NOT NULL CHECK (state IN ('pending','judged','ready','consumed','trained','skipped')),
        skip_reason     TEXT,
        judge_kind      TEXT,
        verdict         INTEGER,
        reward          REAL,
        advantage       REAL,
        weight_lag      INTEGER,
        consumed_version INTEGER,
        train_step      INTEGER,
        trained_version INTEGER,
        requeues        INTEGER NOT NULL DEFAULT 0,
        created_at      REAL NOT NULL,
        judged_at       REAL,
        consumed_at     REAL,
        done_at         REAL,
        rl_signal       INTEGER NOT NULL DEFAULT 1,
        opd_state       TEXT,
        UNIQUE (source, source_id)
    );
    INSERT INTO samples (sample_id, source, source_id, turn_id, group_id, request_key, state, skip_reason,
        judge_kind, verdict, reward, advantage, weight_lag, consumed_version, train_step, trained_version, requeues,
        created_at, judged_at, consumed_at, done_at, rl_signal, opd_state)
        SELECT sample_id, 'turn', turn_id, turn_id, group_id, request_key, state, skip_reason, judge_kind, verdict,
        reward, advantage, weight_lag, consumed_version, train_step, trained_version, requeues, created_at,
        judged_at, consumed_at, done_at, rl_signal, opd_state FROM samples_v3;
    DROP TABLE samples_v3;
    CREATE INDEX samples_by_state ON samples (state, sample_id);
    CREATE INDEX samples_by_group ON samples (group_id, state);
    """,
    # version 5: what each train step trained, in the order the trainer got it (clawrl replay). Written
    # in the transaction that marks the samples trained; the rows of steps a restart lost (trained
    # after the checkpoint it resumed) are deleted when their samples are requeued, so the table holds
    # the surviving lineage only. A store migrated here from version 4 has no rows for the steps
    # trained before: such a run cannot be replayed.
    """
    CREATE TABLE train_batches (
        train_step       INTEGER NOT NULL,   -- the optimizer step (trainer.step after it)
        position         INTEGER NOT NULL,   -- the sample's place in the batch the trainer got, from 0
        sample_id        INTEGER NOT NULL REFERENCES samples(sample_id),
        consumed_version INTEGER NOT NULL,   -- the weight version the step started from
        weight_lag       INTEGER NOT NULL,   -- the sample's staleness at take time (Sample.extra)
        trained_version  INTEGER NOT NULL,   -- the weight version the step produced
        PRIMARY KEY (train_step, position)
    );
    """,
))

EPISODES = TableSet("episodes", "episode_schema_version", (
    # version 1
    """
    CREATE TABLE env_groups (
        group_id    TEXT PRIMARY KEY,        -- hash of (task, round): clawrl.envs.source.group_id
        position    INTEGER NOT NULL UNIQUE, -- the rollout order: task = position % tasks, round = position // tasks
        task_id     TEXT NOT NULL,
        round       INTEGER NOT NULL,
        size        INTEGER NOT NULL,        -- env.group_size when it started
        state       TEXT NOT NULL CHECK (state IN ('rolling', 'complete')),
        outcome     TEXT,                    -- kept, filtered_equal, too_few_healthy, none_healthy, task_removed
        created_at  REAL NOT NULL,
        done_at     REAL
    );
    CREATE INDEX env_groups_by_state ON env_groups (state, position);
    CREATE TABLE episodes (
        episode_id      INTEGER PRIMARY KEY AUTOINCREMENT,
        group_id        TEXT NOT NULL REFERENCES env_groups(group_id),
        member          INTEGER NOT NULL,    -- which of the group's rollouts, 0 .. size - 1
        attempt         INTEGER NOT NULL,    -- 1, then 2.. when an aborted attempt is rolled out again
        task_id         TEXT NOT NULL,
        seed            INTEGER NOT NULL,
        temperature     REAL NOT NULL,       -- of the rollout's logprobs
        state           TEXT NOT NULL CHECK (state IN ('running', 'finished', 'failed', 'aborted')),
        reason          TEXT,                -- why it ended (done, a limit, failed) or was aborted
        error           TEXT,                -- how the environment failed
        reward          REAL,
        done            INTEGER,
        truncated       INTEGER,
        turns           INTEGER,
        malformed       INTEGER,
        prompt_ids      BLOB,
        response_ids    BLOB,
        loss_mask       BLOB,
        logprobs        BLOB,
        weight_versions BLOB,
        info            TEXT,                -- the environment's last info (JSON)
        transcript      TEXT,                -- the conversation as text (JSON), for people
        started_at      REAL NOT NULL,
        finished_at     REAL,
        UNIQUE (group_id, member, attempt)
    );
    CREATE INDEX episodes_by_state ON episodes (state, episode_id);
    CREATE TABLE episode_steps (
        step_id     INTEGER PRIMARY KEY AUTOINCREMENT,
        episode_id  INTEGER NOT NULL REFERENCES episodes(episode_id),
        step_index  INTEGER NOT NULL,        -- the model turn, from 0
        span_start  INTEGER NOT NULL,        -- its sampled ids are response_ids[span_start:span_end], and
        span_end    INTEGER NOT NULL,        -- its context prompt_ids + response_ids[:span_start]
        step_score  INTEGER,                 -- the step judge's -1/0/+1 (env.step_judge=prm), or NULL
        UNIQUE (episode_id, step_index)
    );
    """,
))

OPD = TableSet("OPD", "opd_schema_version", (
    # version 1
    """
    CREATE TABLE opd_hints (
        turn_id         INTEGER PRIMARY KEY REFERENCES turns(turn_id),
        state           TEXT NOT NULL CHECK (state IN ('accepted','rejected','scored','failed')),
        reason          TEXT,               -- why rejected (no_hindsight, vote_split, ...) or failed
        hint            TEXT,
        support         REAL,               -- consensus of the chosen hint among the accepted votes
        judge_kind      TEXT NOT NULL,
        votes           TEXT NOT NULL,      -- JSON: every vote (accept, hint, rationale, raw)
        teacher         TEXT,               -- opd.teacher: policy or a model path
        teacher_prompt_ids BLOB,            -- the hinted prompt, as scored
        teacher_logprobs BLOB,              -- per response token (float64)
        topk            INTEGER,            -- K of the stored top-k (0: none)
        topk_ids        BLOB,               -- [T*K] int32, row-major
        topk_logprobs   BLOB,               -- [T*K] float32, row-major
        weight_version  INTEGER,            -- the teacher's weight version when it scored
        judged_at       REAL NOT NULL,
        scored_at       REAL
    );
    CREATE INDEX opd_hints_by_state ON opd_hints (state, turn_id);
    """,
    # version 2: the teacher's own reply under the hinted prompt (opd.hinted_sample)
    """
    ALTER TABLE opd_hints ADD COLUMN hinted_ids BLOB;
    ALTER TABLE opd_hints ADD COLUMN hinted_logprobs BLOB;
    ALTER TABLE opd_hints ADD COLUMN hinted_temperature REAL
    """,
))
