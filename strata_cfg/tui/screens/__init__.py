"""Screens over the main one: help, explain and diff pages, a yes/no question, a new profile, a launch."""
