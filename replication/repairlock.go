package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrRepairBusy means another process holds the repair lock of the slot:
// a jetbox repair, or a jetbox run repairing on its own
// (--on-lost-slot=repair), is under way.
var ErrRepairBusy = errors.New("another jetbox repair of the slot is running")

// RepairLock is the repair lock of a slot, held: a session-level advisory
// lock on the server that jetbox repair and jetbox run --on-lost-slot=repair
// take before they look at the slot, so that one process at a time repairs
// it. The server releases it when the lock's connection ends (Release, or
// the process dies). OpenRepair and Finish change the marker on the lock's
// connection: a statement there succeeds only while the lock is held, so
// a repair whose lock was lost (its connection cut) never drops the marker
// of another repair that took the lock since.
type RepairLock struct {
	conn *pgx.Conn
	slot string
}

// repairLockKey is the SQL of the lock's key: one bigint per slot name.
const repairLockKey = "hashtextextended('jetbox repair ' || $1, 0)"

// LockRepair takes the repair lock of slot on the server connString reaches
// (with target_session_attrs, the primary), without waiting: ErrRepairBusy
// when another session holds it.
func LockRepair(ctx context.Context, connString, slot string) (*RepairLock, error) {
	pcfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("parse postgres URL: %w", err)
	}
	pcfg.RuntimeParams["application_name"] = "jetbox repair lock"
	// The server probes the lock's connection: a holder cut off without
	// its connection closing (a network cut, no FIN) loses the lock in
	// about 25 s, not after the system's keepalive default (2 hours).
	pcfg.RuntimeParams["tcp_keepalives_idle"] = "10"
	pcfg.RuntimeParams["tcp_keepalives_interval"] = "5"
	pcfg.RuntimeParams["tcp_keepalives_count"] = "3"
	conn, err := pgx.ConnectConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("%w: connect to postgres for the repair lock: %w", ErrUnreachable, err)
	}
	var got bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock("+repairLockKey+")", slot).Scan(&got); err != nil {
		conn.Close(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("take the repair lock of slot %q: %w", slot, err)
	}
	if !got {
		conn.Close(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("%w: slot %q (the session-level advisory lock %s is held; SELECT pid, application_name FROM pg_locks JOIN pg_stat_activity USING (pid) WHERE locktype = 'advisory' shows by whom)",
			ErrRepairBusy, slot, "hashtextextended('jetbox repair "+slot+"', 0)")
	}
	return &RepairLock{conn: conn, slot: slot}, nil
}

// Release gives the lock up (it closes its connection).
func (l *RepairLock) Release(ctx context.Context) {
	if l == nil || l.conn == nil {
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = l.conn.Close(cctx)
}

// Check reports whether the lock is still held: its connection answers (a
// session-level advisory lock lasts as long as its session). A lock whose
// connection was cut (a network cut the server's keepalives ended,
// idle_session_timeout, pg_terminate_backend) may be held by another
// process already: the repair must not publish any more.
func (l *RepairLock) Check(ctx context.Context) error {
	if l == nil || l.conn == nil {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := l.conn.Exec(cctx, "SELECT 1"); err != nil {
		return fmt.Errorf("the repair lock of slot %q is lost (its connection to postgres failed): %w", l.slot, err)
	}
	return nil
}
