package replication

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/check"
)

// standbySlots checks the slots of --wait-for-standby-slots: each must be a
// physical slot on this server (the primary), and a standby should stream
// from it. On PostgreSQL 17+ it points at the server's own setting,
// synchronized_standby_slots, which does the same for failover slots.
func (c *checker) standbySlots() {
	names := c.cfg.StandbySlots.Slots
	if len(names) == 0 {
		return
	}
	if c.inRecovery {
		c.l.Add(check.Error, "postgres.wait_for_standby_slots", "--wait-for-standby-slots waits for the standbys of the primary, and this server is a standby",
			"point --postgres-url at the primary, or leave --wait-for-standby-slots empty")
		return
	}
	// The walsender's sent_lsn (pg_stat_replication) shows only to roles
	// with the privileges of pg_read_all_stats (superusers have them).
	var stats bool
	if err := c.conn.QueryRow(c.ctx, "SELECT pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')").Scan(&stats); err != nil {
		c.fail("postgres.wait_for_standby_slots", err)
		return
	}
	if !stats {
		c.l.Add(check.Error, "postgres.wait_for_standby_slots", "--wait-for-standby-slots reads jetbox's walsender position (sent_lsn in pg_stat_replication), which PostgreSQL shows only to roles with the privileges of pg_read_all_stats",
			"GRANT pg_read_all_stats TO "+pgx.Identifier{c.user()}.Sanitize())
	}
	rows, err := c.conn.Query(c.ctx, `SELECT n.name, s.slot_type, coalesce(s.active, false), s.restart_lsn IS NOT NULL, coalesce(s.wal_status, ''),
		current_setting('server_version_num')::int
		FROM unnest($1::text[]) WITH ORDINALITY AS n(name, i) LEFT JOIN pg_replication_slots s ON s.slot_name = n.name ORDER BY n.i`, names)
	if err != nil {
		c.fail("postgres.wait_for_standby_slots", err)
		return
	}
	type slotRow struct {
		name     string
		typ      *string
		active   bool
		reserved bool
		status   string
		version  int
	}
	slots, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (slotRow, error) {
		var s slotRow
		return s, r.Scan(&s.name, &s.typ, &s.active, &s.reserved, &s.status, &s.version)
	})
	if err != nil {
		c.fail("postgres.wait_for_standby_slots", err)
		return
	}
	var ok []string
	version := 0
	for _, s := range slots {
		version = s.version
		switch {
		case s.typ == nil:
			c.l.Add(check.Error, "postgres.wait_for_standby_slots", fmt.Sprintf("--wait-for-standby-slots names slot %q, which does not exist on this server: jetbox would never publish", s.name),
				fmt.Sprintf("name the physical slot your standby streams from (SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical'), or create it on the primary: SELECT pg_create_physical_replication_slot('%s', true); and on the standby: ALTER SYSTEM SET primary_slot_name = '%s'; SELECT pg_reload_conf()", s.name, s.name))
		case *s.typ != "physical":
			c.l.Add(check.Error, "postgres.wait_for_standby_slots", fmt.Sprintf("--wait-for-standby-slots names slot %q, a %s slot: only a standby's physical slot reports what the standby flushed", s.name, *s.typ),
				"name the physical slot of each standby (SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical')")
		case s.status == "lost":
			c.l.Add(check.Error, "postgres.wait_for_standby_slots", fmt.Sprintf("physical slot %q of --wait-for-standby-slots is invalidated (wal_status lost): its standby cannot catch up, and jetbox would wait for it", s.name),
				fmt.Sprintf("rebuild the standby (pg_basebackup) and recreate the slot: SELECT pg_drop_replication_slot('%s'); SELECT pg_create_physical_replication_slot('%s', true)", s.name, s.name))
		case !s.active || !s.reserved:
			c.l.Add(check.Warning, "postgres.wait_for_standby_slots", fmt.Sprintf("no standby streams from physical slot %q now: jetbox publishes nothing it has not flushed, so publishing waits (warning after --standby-slot-timeout)", s.name),
				fmt.Sprintf("start the standby with primary_slot_name = '%s', or leave the slot out of --wait-for-standby-slots", s.name))
			ok = append(ok, s.name)
		default:
			ok = append(ok, s.name)
		}
	}
	if len(ok) > 0 {
		c.l.Add(check.Info, "postgres.wait_for_standby_slots", fmt.Sprintf("jetbox publishes a transaction only once the standbys of %s flushed it", strings.Join(ok, ", ")), "")
	}
	if version >= 170000 {
		var sss string
		if err := c.conn.QueryRow(c.ctx, "SELECT current_setting('synchronized_standby_slots')").Scan(&sss); err != nil {
			c.fail("postgres.wait_for_standby_slots", err)
			return
		}
		if sss == "" {
			c.l.Add(check.Info, "postgres.synchronized_standby_slots", "PostgreSQL 17+ does what --wait-for-standby-slots does in the server, for failover slots: the walsender sends nothing the standbys of synchronized_standby_slots have not flushed",
				fmt.Sprintf("ALTER SYSTEM SET synchronized_standby_slots = '%s'; SELECT pg_reload_conf(); then --wait-for-standby-slots is not needed (see docs/operations.md, \"Postgres high availability\")", strings.Join(names, ",")))
		} else {
			c.l.Add(check.Info, "postgres.synchronized_standby_slots", fmt.Sprintf("synchronized_standby_slots = '%s': the server already waits for those standbys (failover slots); --wait-for-standby-slots waits in jetbox as well", sss), "")
		}
	}
}
