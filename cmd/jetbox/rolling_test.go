package main

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// TestRollingUpdateOneTakeover plays the chart's rolling update of two
// instances under load (strategy maxSurge 100%, maxUnavailable 0): the new
// pods start and stand by (ready on /readyz?standby=1), then both old pods
// get SIGTERM at once. Exactly one takeover follows: one new instance
// streams, no old standby streamed on its way out, and the stream ends with
// every row once, in order. The time from the SIGTERMs to the new instance
// streaming is logged.
func TestRollingUpdateOneTakeover(t *testing.T) {
	f := newFixture(t)
	o := f.newOracle()
	start := func(addr string) *proc {
		return f.start("JETBOX_HTTP_ADDR="+addr, "JETBOX_STANDBY_RETRY=500ms")
	}
	states := func(addrs []string) []string {
		var s []string
		for _, a := range addrs {
			_, r := getReady(t, a)
			s = append(s, r.State)
		}
		return s
	}
	oldAddrs := []string{httpAddr(t), httpAddr(t)}
	old := []*proc{start(oldAddrs[0]), start(oldAddrs[1])}
	testenv.WaitFor(t, time.Minute, func() error {
		if s := strings.Join(states(oldAddrs), ","); s != "streaming,standby" && s != "standby,streaming" {
			return fmt.Errorf("old instances' states %s, want one streaming and one standby", s)
		}
		return nil
	})
	l := f.startLoad(2, 5*time.Millisecond, 1_000_000)
	defer l.stop()
	count := f.progress(0, time.Minute)

	newAddrs := []string{httpAddr(t), httpAddr(t)}
	upd := []*proc{start(newAddrs[0]), start(newAddrs[1])}
	testenv.WaitFor(t, time.Minute, func() error { // the new pods are Ready
		for _, a := range newAddrs {
			if code, r := getReadyPath(t, a, "/readyz?standby=1"); code != 200 || r.State != "standby" {
				return fmt.Errorf("new instance %s: /readyz?standby=1 = %d, state %q; want 200 standing by", a, code, r.State)
			}
		}
		return nil
	})
	count = f.progress(count, time.Minute)

	signalled := time.Now()
	for _, p := range old {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	testenv.WaitFor(t, time.Minute, func() error {
		if s := strings.Join(states(newAddrs), ","); s != "streaming,standby" && s != "standby,streaming" {
			return fmt.Errorf("new instances' states %s, want one streaming and one standby", s)
		}
		return nil
	})
	takeover := time.Since(signalled)
	for i, p := range old {
		if code := p.wait(time.Minute); code != 0 {
			t.Fatalf("old instance %d exited with %d, want 0 (a clean stop on SIGTERM)", i, code)
		}
	}
	f.progress(count, time.Minute)
	f.finish(l, o)

	// One takeover: the old active streamed once, at its start; the old
	// standby never; of the new pods one did, once.
	streamed := func(p *proc) int { return strings.Count(p.logText(), `"message":"streaming"`) }
	got := []int{streamed(old[0]), streamed(old[1]), streamed(upd[0]), streamed(upd[1])}
	if got[0]+got[1] != 1 || got[2]+got[3] != 1 {
		t.Fatalf(`"streaming" log lines per instance (old, old, new, new) = %v, want one old and one new instance streaming once`, got)
	}
	t.Logf("rolling update of 2 instances under load: SIGTERM of both old ones -> a new one streaming in %s (standby retry 500ms)", takeover.Round(time.Millisecond))
}
