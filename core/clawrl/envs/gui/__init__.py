"""gui-rl's environment: MiniWoB++ tasks and OSWorld-style local-page tasks in headless Chromium
(``env.py``), its browser pool (``browser.py``), the page as an accessibility tree (``screen.py``),
MiniWoB's tasks and scripted solvers (``miniwob_tasks.py``) and the OSWorld task JSON loader
(``osworld.py``)."""
from clawrl.envs.gui.env import GuiEnv

__all__ = ["GuiEnv"]
