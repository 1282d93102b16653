"""swe-rl: SWE-bench-style tasks built from real Python packages, judged by their own test suites.

- ``sdists``: the pinned packages (``packages.toml``) and their cached sdists;
- ``mutations``: SWE-smith-style bugs, one AST mutation each;
- ``build``: ``clawrl env build swe-rl``, the kept bugs as SWE-bench JSONL instances;
- ``instances``: those rows, and official SWE-bench / SWE-Gym / SWE-smith ones, read into one shape;
- ``testbed``: an instance's git working copy in a sandbox, and its tests run there;
- ``evaluate``: resolved, as SWE-bench's harness means it;
- ``env``: ``SweEnv``, the mini-swe-agent-style environment (``env.name=swe``).
"""
