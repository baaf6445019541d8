package main

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// cpuPlan splits the host's CPUs between Postgres and everything else
// (--pin-postgres): Postgres, every process it has and will fork, on
// Postgres; the bench (its writers' connections, the floor client and the
// consumer), the NATS server and the forwarders it starts on Rest. It models
// the set-up the latency goal is meant for, a database with cores of its
// own, on one host.
type cpuPlan struct {
	Postgres, Rest []int
}

// parseCPUPlan parses --pin-postgres: a CPU list such as "0" or "0-1,4",
// each CPU one the bench may run on (allowed), that leaves at least one of
// them to the rest. "" means no pinning (a zero plan).
func parseCPUPlan(list string, allowed []int) (cpuPlan, error) {
	if list == "" {
		return cpuPlan{}, nil
	}
	pg := map[int]bool{}
	for _, part := range strings.Split(list, ",") {
		lo, hi, isRange := strings.Cut(strings.TrimSpace(part), "-")
		a, err1 := strconv.Atoi(lo)
		b := a
		var err2 error
		if isRange {
			b, err2 = strconv.Atoi(hi)
		}
		if err1 != nil || err2 != nil || a < 0 || b < a {
			return cpuPlan{}, fmt.Errorf("--pin-postgres %q: %q is not a CPU number or range (write e.g. 0 or 0-1,4)", list, part)
		}
		for c := a; c <= b; c++ {
			if !slices.Contains(allowed, c) {
				return cpuPlan{}, fmt.Errorf("--pin-postgres %q: CPU %d is not one the bench may use (CPUs %s)", list, c, cpuList(allowed))
			}
			pg[c] = true
		}
	}
	var p cpuPlan
	for _, c := range allowed {
		if pg[c] {
			p.Postgres = append(p.Postgres, c)
		} else {
			p.Rest = append(p.Rest, c)
		}
	}
	if len(p.Rest) == 0 {
		return cpuPlan{}, fmt.Errorf("--pin-postgres %q takes every CPU the bench may use (%s): leave at least one to NATS, the forwarders and the bench", list, cpuList(allowed))
	}
	return p, nil
}

// on reports whether the plan pins anything.
func (p cpuPlan) on() bool { return len(p.Postgres) > 0 }

func cpuSet(cpus []int) *unix.CPUSet {
	var s unix.CPUSet
	for _, c := range cpus {
		s.Set(c)
	}
	return &s
}

// pinSelf confines every thread of the bench to the plan's Rest CPUs. Threads
// the Go runtime starts later, and the processes the bench starts, inherit
// it.
func (p cpuPlan) pinSelf() error {
	if !p.on() {
		return nil
	}
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return fmt.Errorf("list the bench's threads: %w", err)
	}
	set := cpuSet(p.Rest)
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		if err := unix.SchedSetaffinity(tid, set); err != nil && err != unix.ESRCH {
			return fmt.Errorf("pin the bench's thread %d to CPUs %v: %w", tid, p.Rest, err)
		}
	}
	return nil
}

// pinPostgres confines the postmaster and the processes it has forked so far
// to the plan's Postgres CPUs; the backends and walsenders it forks later
// inherit the postmaster's.
func (p cpuPlan) pinPostgres(postmaster int) error {
	if !p.on() {
		return nil
	}
	set := cpuSet(p.Postgres)
	if err := unix.SchedSetaffinity(postmaster, set); err != nil {
		return fmt.Errorf("pin postgres (pid %d) to CPUs %v: %w", postmaster, p.Postgres, err)
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return fmt.Errorf("list /proc: %w", err)
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == postmaster {
			continue
		}
		if st, err := readProcStat(pid); err == nil && st.ppid == postmaster {
			if err := unix.SchedSetaffinity(pid, set); err != nil && err != unix.ESRCH {
				return fmt.Errorf("pin postgres process %d to CPUs %v: %w", pid, p.Postgres, err)
			}
		}
	}
	return nil
}

// describe says where each side runs, for the report's header.
func (p cpuPlan) describe() string {
	if !p.on() {
		return ""
	}
	return fmt.Sprintf("Postgres on CPU %s; NATS, the forwarders and the bench on CPU %s (--pin-postgres)", cpuList(p.Postgres), cpuList(p.Rest))
}

func cpuList(cpus []int) string {
	s := make([]string, len(cpus))
	for i, c := range cpus {
		s[i] = strconv.Itoa(c)
	}
	return strings.Join(s, ",")
}

// allowedCPUs lists the CPUs the bench may run on.
func allowedCPUs() ([]int, error) {
	var s unix.CPUSet
	if err := unix.SchedGetaffinity(0, &s); err != nil {
		return nil, fmt.Errorf("read the bench's CPUs: %w", err)
	}
	var cpus []int
	for c := 0; len(cpus) < s.Count(); c++ {
		if s.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus, nil
}
