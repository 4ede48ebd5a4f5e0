"""The field scripts are programs run by ``tests/test_field.py``, not test modules: importing
them (``--doctest-modules`` imports every ``.py``) must not happen."""

collect_ignore_glob = ["*.py"]
