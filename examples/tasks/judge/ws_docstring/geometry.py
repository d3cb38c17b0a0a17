import math


def circle_area(radius):
    if radius < 0:
        raise ValueError("radius must be >= 0")
    return math.pi * radius ** 2
