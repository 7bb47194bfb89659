from _gpu_placeholder import make_package

make_package(__import__(__name__))
