"""term-csv-to-json: people.json from people.csv (one test per requirement: partial credit)."""
import csv
import json
import pathlib

import pytest

ROWS = [("Ada", 36, "London"), ("Linus", 28, "Helsinki"), ("Grace", 45, "Arlington"), ("Guido", 39, "Haarlem")]


@pytest.fixture
def data():
    p = pathlib.Path("people.json")
    assert p.is_file(), "people.json missing"
    return json.loads(p.read_text())


def test_is_list_of_objects(data):
    assert isinstance(data, list) and all(isinstance(r, dict) for r in data)


def test_names_in_order(data):
    assert [r.get("name") for r in data] == [r[0] for r in ROWS]


def test_ages_are_integers(data):
    assert [r.get("age") for r in data] == [r[1] for r in ROWS]
    assert all(type(r["age"]) is int for r in data)


def test_city_kept(data):
    assert [r.get("city") for r in data] == [r[2] for r in ROWS]


def test_csv_untouched():
    with open("people.csv", newline="") as f:
        assert [(r["name"], int(r["age"]), r["city"]) for r in csv.DictReader(f)] == ROWS
