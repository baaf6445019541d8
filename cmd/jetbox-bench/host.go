package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// hostUsage is what the host's kernel did during a measurement beside the
// processes' CPU: how much free memory it started with, how many page-cache
// pages it reclaimed to make room (by kswapd, and directly in the process
// that wanted the page, which is charged as that process's kernel time), how
// many allocations waited for compaction, how much free memory it handed back
// to its hypervisor, and the NATS server's system calls, page faults and
// context switches: what a growth of the server's kernel time per event may
// come from (docs/performance.md, "How cost grows with the work").
type hostUsage struct {
	FreeAtStart     int64 // MemFree when the measurement began, bytes
	Reclaimed       int64 // page-cache bytes reclaimed, kswapd and direct
	DirectReclaimed int64 // the part reclaimed by the allocating process itself
	CompactStalls   int64 // allocations that waited for the kernel to compact memory (direct compaction)
	ReportedToHost  int64 // bytes of free memory the guest handed back to its hypervisor (free page reporting); -1 where the kernel does not say
	NATSSyscalls    int64 // read and write system calls of the NATS server (syscr + syscw)
	NATSFaults      int64 // the NATS server's minor page faults (memory it touched for the first time since the kernel took it back)
	NATSSwitches    int64 // the NATS server's context switches, voluntary and not, over all its threads
	// The NATS figures are -1 where not readable (no server, or it exited).
}

// reportedKiB is where a guest kernel with free page reporting counts what
// it reported (not every kernel has it).
const reportedKiB = "/sys/module/page_reporting/parameters/reported_kib"

// hostSnapshot is one reading of the counters behind hostUsage.
type hostSnapshot struct {
	free, stealKswapd, stealDirect, natsSyscalls, natsFaults, natsSwitches int64
	compactStalls, reported                                                int64
}

// readHost reads /proc/meminfo, /proc/vmstat, the free page reporting count
// and the NATS server's /proc/PID/io, stat and threads' status (natsPID 0:
// none).
func readHost(natsPID int) (hostSnapshot, error) {
	var s hostSnapshot
	mem, err := readKeyed("/proc/meminfo", ":")
	if err != nil {
		return s, err
	}
	vm, err := readKeyed("/proc/vmstat", " ")
	if err != nil {
		return s, err
	}
	s.free = mem["MemFree"] * 1024 // kB
	s.stealKswapd, s.stealDirect = vm["pgsteal_kswapd"], vm["pgsteal_direct"]
	s.compactStalls = vm["compact_stall"]
	s.reported = -1
	if b, err := os.ReadFile(reportedKiB); err == nil {
		if kib, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil {
			s.reported = kib * 1024
		}
	}
	s.natsSyscalls, s.natsFaults, s.natsSwitches = -1, -1, -1
	if natsPID > 0 {
		// /proc/PID/io is readable by the process's owner and root only.
		if io, err := readKeyed(fmt.Sprintf("/proc/%d/io", natsPID), ":"); err == nil {
			s.natsSyscalls = io["syscr"] + io["syscw"]
		}
		if st, err := readProcStat(natsPID); err == nil {
			s.natsFaults = st.minorFaults
		}
		if n, err := threadSwitches(natsPID); err == nil {
			s.natsSwitches = n
		}
	}
	return s, nil
}

// since is the usage from s to now.
func (s hostSnapshot) since(now hostSnapshot) hostUsage {
	page := int64(os.Getpagesize())
	u := hostUsage{FreeAtStart: s.free, NATSSyscalls: -1, NATSFaults: -1, NATSSwitches: -1,
		Reclaimed:       (now.stealKswapd - s.stealKswapd + now.stealDirect - s.stealDirect) * page,
		DirectReclaimed: (now.stealDirect - s.stealDirect) * page,
		CompactStalls:   now.compactStalls - s.compactStalls, ReportedToHost: -1}
	if s.reported >= 0 && now.reported >= 0 {
		u.ReportedToHost = now.reported - s.reported
	}
	diff := func(a, b int64) int64 {
		if a < 0 || b < 0 {
			return -1 // not readable at one end
		}
		return b - a
	}
	u.NATSSyscalls = diff(s.natsSyscalls, now.natsSyscalls)
	u.NATSFaults = diff(s.natsFaults, now.natsFaults)
	u.NATSSwitches = diff(s.natsSwitches, now.natsSwitches)
	return u
}

// threadSwitches adds up the context switches of every thread of pid
// (/proc/PID/status counts the main thread's only). A thread that ended in
// between takes its count with it, so a difference can undercount.
func threadSwitches(pid int) (int64, error) {
	dir := fmt.Sprintf("/proc/%d/task", pid)
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return 0, fmt.Errorf("list threads of pid %d: %w", pid, err)
	}
	var n int64
	for _, t := range tasks {
		st, err := readKeyed(dir+"/"+t.Name()+"/status", ":")
		if err != nil {
			continue // ended meanwhile
		}
		n += st["voluntary_ctxt_switches"] + st["nonvoluntary_ctxt_switches"]
	}
	return n, nil
}

// readKeyed reads a /proc file of "key<sep> value [unit]" lines into a map;
// lines whose value is not an integer are left out.
func readKeyed(path, sep string) (map[string]int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	return parseKeyed(b, sep), nil
}

// parseKeyed parses the text of a keyed /proc file (see readKeyed).
func parseKeyed(b []byte, sep string) map[string]int64 {
	m := make(map[string]int64)
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		key, rest, ok := strings.Cut(sc.Text(), sep)
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		if v, err := strconv.ParseInt(f[0], 10, 64); err == nil {
			m[strings.TrimSpace(key)] = v
		}
	}
	return m
}

// dropPageCache drops the clean page cache (--drop-caches, after settle's
// sync), so that a timed run writes into memory the host used moments
// before rather than memory it has not touched for long, which is slow to
// write to on a VM that hands its free memory back to the hypervisor
// (docs/performance.md, "How cost grows with the work"). Needs root.
func dropPageCache() error {
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("1"), 0); err != nil {
		return fmt.Errorf("drop the page cache (--drop-caches needs root): %w", err)
	}
	return nil
}
