package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/pgcluster"
)

// Major returns the server's major version (15, 17...).
func (p *Postgres) Major(t testing.TB) int {
	t.Helper()
	conn := p.Conn(t)
	var num int
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&num); err != nil {
		t.Fatal(err)
	}
	return num / 10000
}

// Snapshot copies the data directory of the stopped server (a cold copy,
// like a disk snapshot) and returns a function that puts it back: the
// server must be stopped when either runs.
func (p *Postgres) Snapshot(t testing.TB) (restore func()) {
	t.Helper()
	snap := p.c.DataDir() + ".snapshot"
	if out, err := exec.Command("cp", "-a", p.c.DataDir(), snap).CombinedOutput(); err != nil {
		t.Fatalf("snapshot the data directory: %v\n%s", err, out)
	}
	return func() {
		t.Helper()
		if err := os.RemoveAll(p.c.DataDir()); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("cp", "-a", snap, p.c.DataDir()).CombinedOutput(); err != nil {
			t.Fatalf("restore the data directory: %v\n%s", err, out)
		}
	}
}

// StartStandby makes a physical streaming standby of primary on loopback: it
// creates the physical slot "standby1" on primary, stops primary cleanly,
// copies its data directory (the npm builds have no pg_basebackup), starts
// primary again and starts the copy with standby.signal, primary_conninfo
// and primary_slot_name. On PostgreSQL 17+ the standby synchronises failover
// slots (sync_replication_slots, hot_standby_feedback) and primary waits for
// it before logical walsenders send changes (synchronized_standby_slots).
// Extra "name=value" settings of the standby come last (they override).
func StartStandby(t testing.TB, primary *Postgres, extra ...string) *Postgres {
	t.Helper()
	return StartNamedStandby(t, primary, "standby1", extra...)
}

// StartNamedStandby is StartStandby with another name than standby1 (the
// physical slot and application_name): a second standby of primary. Only
// standby1 is in the primary's synchronized_standby_slots.
func StartNamedStandby(t testing.TB, primary *Postgres, name string, extra ...string) *Postgres {
	t.Helper()
	major := primary.Major(t)
	primary.Exec(t, fmt.Sprintf("SELECT pg_create_physical_replication_slot('%s', true)", name))
	if major >= 17 && name == "standby1" {
		primary.Exec(t, "ALTER SYSTEM SET synchronized_standby_slots = 'standby1'")
	}
	primary.Stop("fast")
	// The upstream goes in postgresql.auto.conf, not on the command line
	// (which ALTER SYSTEM cannot override): a test can point the standby
	// at another upstream with ALTER SYSTEM and pg_reload_conf().
	upstream := fmt.Sprintf("primary_conninfo = 'host=127.0.0.1 port=%d user=postgres dbname=postgres application_name=%s'\nprimary_slot_name = '%s'\n", primary.Port(), name, name)
	settings := []string{"hot_standby_feedback=on", "wal_receiver_status_interval=1s"}
	if major >= 17 {
		// The copy carries the primary's synchronized_standby_slots: a
		// promoted standby must not wait for a standby of its own.
		settings = append(settings, "sync_replication_slots=on", "synchronized_standby_slots=")
	}
	settings = append(settings, extra...)
	bin, err := pgcluster.FindBinDir()
	if err != nil {
		t.Fatal(err)
	}
	s := &Postgres{t: t}
	s.c, err = pgcluster.New(pgcluster.Options{BinDir: bin, Port: FreePort(t), Template: primary.DataDir(), Settings: settings})
	primary.Start()
	if err != nil {
		t.Fatal(err)
	}
	s.DSN = s.c.DSN
	t.Cleanup(func() {
		_ = s.c.Stop("immediate")
		if t.Failed() {
			t.Logf("standby log (last 4KiB):\n%s", s.c.LogTail(4096))
		}
		s.c.Remove()
	})
	if err := appendFile(filepath.Join(s.c.DataDir(), "postgresql.auto.conf"), upstream); err != nil {
		t.Fatal(err)
	}
	// The copy holds postmaster.opts, not postmaster.pid (clean stop).
	if err := os.WriteFile(filepath.Join(s.c.DataDir(), "standby.signal"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	s.Start()
	WaitFor(t, time.Minute, func() error {
		var state string
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		conn := primary.Conn(t)
		defer conn.Close(ctx)
		err := conn.QueryRow(ctx, "SELECT state FROM pg_stat_replication WHERE application_name = $1", name).Scan(&state)
		if err != nil {
			return fmt.Errorf("standby not connected: %w", err)
		}
		if state != "streaming" {
			return fmt.Errorf("standby %s", state)
		}
		return nil
	})
	return s
}

// Promote promotes a standby and waits until it accepts writes.
func (p *Postgres) Promote(t testing.TB) {
	t.Helper()
	p.Exec(t, "SELECT pg_promote(true, 60)")
	WaitFor(t, time.Minute, func() error {
		conn := p.Conn(t)
		var rec bool
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		defer conn.Close(ctx)
		if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&rec); err != nil {
			return err
		}
		if rec {
			return ErrNotYet
		}
		return nil
	})
}

// Timeline returns the server's current timeline.
func (p *Postgres) Timeline(t testing.TB) int {
	t.Helper()
	conn := p.Conn(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	defer conn.Close(ctx)
	var tl string
	if err := conn.QueryRow(ctx, "SELECT timeline_id::text FROM pg_control_checkpoint()").Scan(&tl); err != nil {
		t.Fatal(err)
	}
	n, _ := strconv.Atoi(strings.TrimSpace(tl))
	return n
}

// appendFile appends text to the existing file path (its owner unchanged).
func appendFile(path, text string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("append to %s: %w", path, err)
	}
	if _, err := f.WriteString(text); err != nil {
		f.Close()
		return fmt.Errorf("append to %s: %w", path, err)
	}
	return f.Close()
}
