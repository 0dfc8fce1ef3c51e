# gnuplot -e "datafile='docs/perf/nvme/sweep.dat'" docs/perf/nvme/sweep.gp > docs/perf/nvme/sweep.png
set terminal pngcairo size 1100,450 font ",10"
set multiplot layout 1,2
set logscale x 2
set xlabel "queue depth"
set ylabel "GB/s"
set key top left
set grid
do for [op=0:1] {
  set title (op == 0 ? "sequential read" : "sequential write")
  plot for [b=0:3] datafile index op every :::b::b using 1:3 with linespoints lw 2 lc b+1 title sprintf("strata %s", word("64K 256K 1M 4M", b+1)), \
       for [b=0:3] datafile index op every :::b::b using 1:4 with lines dt 2 lc b+1 title sprintf("fio %s", word("64K 256K 1M 4M", b+1))
}
unset multiplot
