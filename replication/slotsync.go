package replication

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// StandbySlot is what a standby shows of jetbox's failover slot (PostgreSQL
// 17+): whether the slotsync machinery copied it there, and whether that
// copy is persisted. PostgreSQL drops a synced copy that is still temporary
// at promotion, so only a persisted one keeps the slot across a failover.
type StandbySlot struct {
	// Version is the standby's server_version_num.
	Version int
	// InRecovery: the server is a standby (pg_is_in_recovery()).
	InRecovery bool
	// Exists: the standby has a slot of that name; Synced and Temporary are
	// its pg_replication_slots.synced and temporary columns.
	Exists, Synced, Temporary bool
	// SyncWorker: sync_replication_slots = on (the slotsync worker runs, and
	// refuses pg_sync_replication_slots()).
	SyncWorker bool
	// Invalidated is the copy's invalidation_reason, if any.
	Invalidated string
}

// Ready reports that a promotion of this standby now keeps the slot: it is a
// standby holding a synced, persisted, valid copy.
func (s StandbySlot) Ready() bool {
	return s.InRecovery && s.Exists && s.Synced && !s.Temporary && s.Invalidated == ""
}

// State says in a few words why the standby is ready or not.
func (s StandbySlot) State() string {
	switch {
	case s.Version < 170000:
		return fmt.Sprintf("PostgreSQL %d has no failover slots (17+): a promotion of this server loses the slot", s.Version/10000)
	case !s.InRecovery:
		return "not a standby (pg_is_in_recovery() is false): it keeps no copy of the primary's slot"
	case !s.Exists:
		return "no copy of the slot yet (the slotsync worker or pg_sync_replication_slots() has not synchronised it)"
	case !s.Synced:
		return "a slot of that name that is not synchronised from the primary (synced = false)"
	case s.Invalidated != "":
		return "the synchronised copy is invalidated (" + s.Invalidated + ")"
	case s.Temporary:
		return "synchronised but still temporary: PostgreSQL drops it at promotion (it is persisted once the primary's slot has moved past what this standby holds)"
	}
	return "synchronised and persisted: a promotion of this standby keeps the slot"
}

// ReadStandbySlot reads on conn, a connection to a standby, its copy of
// slot.
func ReadStandbySlot(ctx context.Context, conn *pgx.Conn, slot string) (StandbySlot, error) {
	var s StandbySlot
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int, pg_is_in_recovery()").Scan(&s.Version, &s.InRecovery); err != nil {
		return s, fmt.Errorf("read the server version: %w", err)
	}
	if s.Version < 170000 || !s.InRecovery {
		return s, nil
	}
	var worker string
	if err := conn.QueryRow(ctx, "SELECT current_setting('sync_replication_slots')").Scan(&worker); err != nil {
		return s, fmt.Errorf("read sync_replication_slots: %w", err)
	}
	s.SyncWorker = worker == "on"
	var reason *string
	err := conn.QueryRow(ctx, "SELECT synced, temporary, invalidation_reason FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&s.Synced, &s.Temporary, &reason)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return s, nil
	case err != nil:
		return s, fmt.Errorf("read slot %q: %w", slot, err)
	}
	s.Exists = true
	if reason != nil {
		s.Invalidated = *reason
	}
	return s, nil
}

// ErrSyncWorker: the standby's slotsync worker runs (sync_replication_slots
// = on). PostgreSQL 17 refuses pg_sync_replication_slots() then ("cannot
// synchronize replication slots concurrently": the worker holds the sync
// for as long as it runs), and the worker synchronises on its own schedule
// (every 200 ms to 30 s).
var ErrSyncWorker = errors.New("the standby's slotsync worker synchronises the slots (sync_replication_slots = on): pg_sync_replication_slots() is refused while it runs")

// SyncStandbySlots asks a standby to synchronise the failover slots from
// its primary now (pg_sync_replication_slots()), instead of waiting for its
// slotsync worker. It returns ErrSyncWorker when the worker runs.
func SyncStandbySlots(ctx context.Context, conn *pgx.Conn) error {
	_, err := conn.Exec(ctx, "SELECT pg_sync_replication_slots()")
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55000" && pgErr.Message == "cannot synchronize replication slots concurrently" {
		return ErrSyncWorker
	}
	if err != nil {
		return fmt.Errorf("pg_sync_replication_slots(): %w (the standby needs primary_slot_name, hot_standby_feedback = on, a dbname in primary_conninfo, and a user with the REPLICATION attribute)", err)
	}
	return nil
}
