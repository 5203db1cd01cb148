"""Scripts of the function-task checker that run inside sandboxes (standard library only).

``callee.py`` runs the candidate's function on given inputs in the candidate's sandbox;
``judge.py`` runs the task's hidden ``check`` in a second sandbox that never runs candidate code;
``wire.py`` is the value format between them. The host side is
:mod:`coderl.grading.function`.
"""
