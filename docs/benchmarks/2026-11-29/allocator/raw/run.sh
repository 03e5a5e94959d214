#!/bin/bash
# usage: run.sh URI NAME extra fio args...
uri=$1; name=$2; shift 2
fio --name=$name --ioengine=nbd --uri="$uri" --size=2G --randseed=42 --refill_buffers "$@" --output-format=json 2>/dev/null | sed -n '/^{/,$p' | python3 -c '
import json,sys; d=json.load(sys.stdin); j=d["jobs"][0]
print("%s read %.0f MB/s write %.0f MB/s  fio cpu %.0f%%" % (sys.argv[1], j["read"]["bw_bytes"]/1e6, j["write"]["bw_bytes"]/1e6, j["usr_cpu"]+j["sys_cpu"]))' $name
