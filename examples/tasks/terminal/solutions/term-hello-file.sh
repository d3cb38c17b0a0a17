printf 'Hello, Gyre!\n' > hello.txt
