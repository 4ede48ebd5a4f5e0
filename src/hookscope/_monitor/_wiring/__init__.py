"""A Monitor's hooks, built and connected once (``_build.py``): on the model's modules
(``_modules.py``), around each optimizer update (``_update.py``, ``_optim.py``), and the
listener that hears the script's own calls into torch (``_calls.py``, ``_heard.py``).
"""
