module wavekv

go 1.19
