module example.com/cryptd-example

go 1.19
