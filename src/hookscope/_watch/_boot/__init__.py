"""The start-up directory of ``hookscope watch``: it holds only ``sitecustomize.py``.

``hookscope watch`` puts this directory first on the command's ``PYTHONPATH``, so that every
Python process of the command (the script, ``torchrun`` workers, DataLoader workers) imports
``sitecustomize`` from here at start-up. Nothing imports this package otherwise.
"""
