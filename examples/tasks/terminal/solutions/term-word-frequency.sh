tr 'A-Z' 'a-z' < poem.txt | grep -oE '[a-z]+' | sort | uniq -c | sort -k1,1nr -k2 | head -3 | awk '{print $2}' > top3.txt
