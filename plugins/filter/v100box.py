"""Registers the project's Jinja filters; the functions live in controller.ansible_filters."""

from controller.ansible_filters import filters


class FilterModule:
    def filters(self):
        return filters()
