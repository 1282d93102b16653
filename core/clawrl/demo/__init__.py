"""``clawrl demo method=rl|opd|combine``: watch a method learn a simulated user's hidden preference.

The demo starts the real gateway and learner in-process, then a simulated user (``users``) chats
with it through the ``openai`` client: one question, the model's reply, the user's natural
feedback. Every few interactions it measures how often the model satisfies the preference on
held-out questions (``evaluation``) and finally writes a table and a PNG (``plot``) to the run
directory. ``run`` holds the loop and the CLI entry point.
"""
