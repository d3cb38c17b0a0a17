mkdir -p logs && n=$(ls *.log | wc -l) && mv *.log logs/ && echo "$n" > count.txt
