package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// TestFailoverSlotReady (PostgreSQL 17+): jetbox run with --standby-urls
// naming the streaming standby and an unreachable one, under a light write
// load. While the standby's replay is paused (it cannot persist a copy of
// the slot jetbox creates meanwhile) jetbox_failover_slot_ready{standby} is
// 0, /readyz warns and stays ready, and jetbox check warns; once replay
// resumes and the copy is persisted, the metric is 1 and that warning
// clears, while the unreachable standby stays 0 with its own warning.
// jetbox check then lists the standby's copy (INFO) and the unreachable one
// (WARNING) and exits 0. Once with the standby's slotsync worker
// (sync_replication_slots = on: PostgreSQL refuses
// pg_sync_replication_slots()), once without it (jetbox calls it every
// --monitor-interval). With JETBOX_TEST_SLOT_WINDOW_IDLE it measures the
// window instead: the slot's creation on the primary to the persisted copy
// on the standby, the standby idle that long first (docs/operations.md).
func TestFailoverSlotReady(t *testing.T) {
	for _, mode := range []struct {
		name   string
		worker bool
	}{{"slotsync-worker", true}, {"pg_sync_replication_slots", false}} {
		t.Run(mode.name, func(t *testing.T) {
			testenv.SkipIfShort(t)
			var extra []string
			if !mode.worker {
				extra = append(extra, "sync_replication_slots=off")
			}
			f, _, sb, major := haFixture(t, extra...)
			if major < 17 {
				t.Skipf("PostgreSQL %d has no failover slots (17+): run with JETBOX_PG_BINDIR=$(.ci/fetch-postgres 17)", major)
			}
			sconn := sb.Conn(t)
			idle, measure := os.LookupEnv("JETBOX_TEST_SLOT_WINDOW_IDLE")
			if measure {
				// The window as it is: the standby idle that long first
				// (the slotsync worker's naptime grows to 30 s meanwhile).
				d, err := time.ParseDuration(idle)
				must(t, err)
				time.Sleep(d) // the measured condition, not a synchronisation
			} else {
				// Hold the window open: the standby replays no WAL, so it
				// cannot persist a copy of a slot created meanwhile.
				sb.Exec(t, "SELECT pg_wal_replay_pause()")
			}
			l := f.startLoad(1, 100*time.Millisecond, 1_000_000) // about 10 transactions a second
			defer l.stop()
			addr := httpAddr(t)
			dead := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=2", testenv.FreePort(t))
			live, deadName := standbyName(sb.DSN), standbyName(dead)
			gauge := func(name string) string { return fmt.Sprintf("jetbox_failover_slot_ready{standby=%q}", name) }
			urls := sb.DSN + ", " + dead
			if os.Getenv("JETBOX_TEST_SLOT_WINDOW_NO_URLS") != "" {
				urls = "" // the window without jetbox watching (and syncing)
			}
			p := f.start("JETBOX_STANDBY_URLS="+urls, "JETBOX_HTTP_ADDR="+addr, "JETBOX_MONITOR_INTERVAL=200ms")
			f.waitStreaming(p)
			created := slotCreated(t, p)
			check := func() string {
				var out, errOut bytes.Buffer
				if code := realMain([]string{"check", "--postgres-url=" + f.pgURL, "--nats-url=" + f.natURL, "--standby-urls=" + sb.DSN + "," + dead}, &out, &errOut); code != exitOK {
					t.Fatalf("check: exit %d:\n%s%s", code, out.String(), errOut.String())
				}
				return out.String()
			}
			wantCheck := func(out string, want ...string) {
				t.Helper()
				for _, w := range want {
					if !strings.Contains(out, w) {
						t.Errorf("check output lacks %q:\n%s", w, out)
					}
				}
			}
			deadFinding := fmt.Sprintf("WARNING  postgres.standby_slot            standby %s: cannot read slot \"jetbox\" there", deadName)

			if !measure {
				// Not persisted: 0, a warning naming the standby, a WARNING
				// in check; jetbox streams.
				testenv.WaitFor(t, time.Minute, func() error {
					m := scrape(t, addr)
					code, r := getReady(t, addr)
					if v, ok := m[gauge(live)]; !ok || v != 0 {
						return fmt.Errorf("%s = %v (exported: %v), want 0", gauge(live), v, ok)
					}
					if code != 200 {
						return fmt.Errorf("/readyz %d: %+v", code, r)
					}
					for _, w := range r.Warnings {
						if strings.Contains(w, "standby "+live+": slot \"jetbox\"") {
							return nil
						}
					}
					return fmt.Errorf("/readyz does not warn about the standby: %+v", r.Warnings)
				})
				wantCheck(check(), fmt.Sprintf("WARNING  postgres.standby_slot            standby %s: slot \"jetbox\" ", live), deadFinding)
				f.progress(50, time.Minute)
				sb.Exec(t, "SELECT pg_wal_replay_resume()")
				created = time.Now()
			}
			var persisted time.Time
			testenv.WaitFor(t, time.Minute, func() error {
				var ready int
				if err := sconn.QueryRow(ctxT(t, 5*time.Second), "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'jetbox' AND synced AND NOT temporary").Scan(&ready); err != nil {
					return err
				}
				if ready != 1 {
					return fmt.Errorf("the standby's copy is not persisted yet; jetbox's log:\n%s", logLines(p, "standby-slots"))
				}
				persisted = time.Now()
				return nil
			})
			if measure {
				t.Logf("%s (standby idle %s, --standby-urls %q): slot created on the primary -> persisted on the standby: %s", mode.name, idle, urls, persisted.Sub(created).Round(10*time.Millisecond))
				return
			}
			t.Logf("%s: replay resumed -> persisted on the standby: %s", mode.name, persisted.Sub(created).Round(10*time.Millisecond))
			testenv.WaitFor(t, time.Minute, func() error {
				m := scrape(t, addr)
				code, r := getReady(t, addr)
				if m[gauge(live)] != 1 {
					return fmt.Errorf("%s = %v", gauge(live), m[gauge(live)])
				}
				if v, ok := m[gauge(deadName)]; !ok || v != 0 {
					return fmt.Errorf("%s = %v (exported: %v), want 0", gauge(deadName), v, ok)
				}
				if code != 200 || !r.Ready {
					return fmt.Errorf("/readyz %d: %+v", code, r)
				}
				var deadWarned bool
				for _, w := range r.Warnings {
					if strings.Contains(w, "standby "+live+":") {
						return fmt.Errorf("/readyz still warns: %q", w)
					}
					deadWarned = deadWarned || strings.Contains(w, "standby "+deadName+":")
				}
				if !deadWarned {
					return fmt.Errorf("/readyz does not warn about the unreachable standby: %+v", r.Warnings)
				}
				return nil
			})
			if !strings.Contains(p.logText(), "a promotion of this standby keeps the slot") {
				t.Errorf("no log line for the persisted copy:\n%s", p.tail(4096))
			}

			wantCheck(check(), fmt.Sprintf("INFO     postgres.standby_slot            standby %s: slot \"jetbox\" synchronised and persisted", live), deadFinding)
			l.stop()
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d:\n%s", code, p.tail(4096))
			}
		})
	}
}

// slotCreated returns when jetbox created its slot: the time of its log
// line "created replication slot" (written right after the creation).
func slotCreated(t *testing.T, p *proc) time.Time {
	t.Helper()
	for _, line := range strings.Split(p.logText(), "\n") {
		if !strings.Contains(line, `"created replication slot`) {
			continue
		}
		var l struct {
			Time time.Time `json:"time"`
		}
		must(t, json.Unmarshal([]byte(line), &l))
		return l.Time
	}
	t.Fatalf("jetbox did not create the slot:\n%s", p.tail(4096))
	return time.Time{}
}

// logLines are p's log lines that contain s.
func logLines(p *proc, s string) string {
	var out []string
	for _, l := range strings.Split(p.logText(), "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
