"""User commands on top of the flow: plan, inspect, verify, compare, migrate."""
