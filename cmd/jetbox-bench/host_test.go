package main

import "testing"

func TestParseKeyed(t *testing.T) {
	mem := parseKeyed([]byte("MemTotal:       24683520 kB\nMemFree:        18975744 kB\nHugePages_Total:       0\n"), ":")
	if mem["MemFree"] != 18975744 || mem["HugePages_Total"] != 0 || len(mem) != 3 {
		t.Fatalf("meminfo: %v", mem)
	}
	vm := parseKeyed([]byte("nr_dirty 12\npgsteal_direct 1325575\nbad line\n"), " ")
	if vm["pgsteal_direct"] != 1325575 || vm["nr_dirty"] != 12 || len(vm) != 2 {
		t.Fatalf("vmstat: %v", vm)
	}
	io := parseKeyed([]byte("rchar: 10\nsyscr: 7\nsyscw: 5\n"), ":")
	if io["syscr"]+io["syscw"] != 12 {
		t.Fatalf("io: %v", io)
	}
}

func TestHostSince(t *testing.T) {
	page := int64(4096)
	a := hostSnapshot{free: 1 << 30, stealKswapd: 10, stealDirect: 1, natsSyscalls: 100}
	b := hostSnapshot{free: 1 << 20, stealKswapd: 30, stealDirect: 6, natsSyscalls: 250}
	u := a.since(b)
	if u.FreeAtStart != 1<<30 || u.NATSSyscalls != 150 {
		t.Fatalf("usage: %+v", u)
	}
	if u.Reclaimed%page != 0 || u.Reclaimed/u.DirectReclaimed != 5 {
		t.Fatalf("reclaim: %+v", u)
	}
	if u := (hostSnapshot{natsSyscalls: -1}).since(b); u.NATSSyscalls != -1 {
		t.Fatalf("unreadable io: %+v", u)
	}
}
