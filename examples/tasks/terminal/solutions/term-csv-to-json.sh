python3 -c '
import csv, json
rows = [dict(r, age=int(r["age"])) for r in csv.DictReader(open("people.csv", newline=""))]
json.dump(rows, open("people.json", "w"), indent=2)
'
