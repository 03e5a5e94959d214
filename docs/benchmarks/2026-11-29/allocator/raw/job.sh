#!/bin/bash
# usage: job.sh NAME fio-args... ; prints fio result + server cpu
name=$1; shift
cd /tmp/p0; pid=$(cat srv.pid); D=$(cat dopts)
(sleep 2; pidstat -u -p $pid 10 1 | awk -v l="$name" '/Average/{printf "%s server cpu %s%% usr %s sys %s\n", l, $8, $4, $5}') &
/tmp/w/run.sh "nbd+unix:///dedupvol?socket=/tmp/p0/dv.sock" $name $D --time_based --runtime=15 "$@"
wait
