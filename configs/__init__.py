"""The experiment configs (``python train.py --list_configs`` lists them with their arguments).

A package so that the files share ``configs/common.py`` by ``from configs import common``;
train.py puts the folder above ``configs/`` on ``sys.path`` when it loads a file by path.
"""
