package replication

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/check"
)

// failover reports what the primary shows of its readiness to keep the
// slot across a promotion: the server version (failover slots need 17),
// the slot's failover flag, synchronized_standby_slots and, through the
// standbys' physical slots, whether they send hot_standby_feedback.
func (c *checker) failover() {
	if c.inRecovery {
		return
	}
	var num int
	if err := c.conn.QueryRow(c.ctx, "SELECT current_setting('server_version_num')::int").Scan(&num); err != nil {
		c.fail("postgres.failover", err)
		return
	}
	if num < 170000 {
		c.l.Add(check.Info, "postgres.failover", fmt.Sprintf("PostgreSQL %d has no failover slots: after a promotion the slot is gone and jetbox stops with the lost-slot error (exit 2) until `jetbox repair`", num/10000), "")
		return
	}
	var failover *bool
	err := c.conn.QueryRow(c.ctx, "SELECT failover FROM pg_replication_slots WHERE slot_name = $1", c.cfg.Slot).Scan(&failover)
	switch {
	case err == pgx.ErrNoRows:
	case err != nil:
		c.fail("postgres.failover", err)
		return
	case failover != nil && !*failover:
		c.l.Add(check.Warning, "postgres.failover", fmt.Sprintf("slot %q has failover = false: standbys do not keep it, so a promotion loses it", c.cfg.Slot),
			fmt.Sprintf("stop jetbox, then psql \"dbname=%s replication=database\" -c 'ALTER_REPLICATION_SLOT %s (FAILOVER true)'", c.database(), c.cfg.Slot))
	default:
		c.l.Add(check.Info, "postgres.failover", fmt.Sprintf("slot %q has failover = true: standbys with sync_replication_slots = on keep it", c.cfg.Slot), "")
	}
	var sss string
	if err := c.conn.QueryRow(c.ctx, "SELECT current_setting('synchronized_standby_slots')").Scan(&sss); err != nil {
		c.fail("postgres.failover", err)
		return
	}
	// jetbox repair's markers (RepairMarker) are physical slots of no
	// standby: naming one in synchronized_standby_slots would make the
	// logical walsender wait for it for ever once the repair drops it.
	rows, err := c.conn.Query(c.ctx, "SELECT slot_name, xmin IS NOT NULL OR catalog_xmin IS NOT NULL FROM pg_replication_slots WHERE slot_type = 'physical' AND slot_name NOT LIKE 'jetbox\\_repair\\_%' ORDER BY slot_name")
	if err != nil {
		c.fail("postgres.failover", err)
		return
	}
	type phys struct {
		name     string
		feedback bool
	}
	slots, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (phys, error) {
		var p phys
		return p, r.Scan(&p.name, &p.feedback)
	})
	if err != nil {
		c.fail("postgres.failover", err)
		return
	}
	if len(slots) == 0 {
		c.l.Add(check.Info, "postgres.synchronized_standby_slots", "no physical replication slot: no standby of this primary keeps jetbox's slot",
			"give each standby a physical slot (primary_slot_name), sync_replication_slots = on and hot_standby_feedback = on, and name the slots in synchronized_standby_slots here")
		return
	}
	var names []string
	for _, s := range slots {
		names = append(names, s.name)
		if !s.feedback {
			c.l.Add(check.Warning, "postgres.hot_standby_feedback", fmt.Sprintf("the standby on physical slot %q sends no hot_standby_feedback (the slot holds no xmin): it cannot synchronise jetbox's slot", s.name),
				"on that standby: ALTER SYSTEM SET hot_standby_feedback = on; ALTER SYSTEM SET sync_replication_slots = on; SELECT pg_reload_conf()")
		}
	}
	if strings.TrimSpace(sss) == "" {
		c.l.Add(check.Warning, "postgres.synchronized_standby_slots", "synchronized_standby_slots is empty: jetbox may receive changes a standby has not got, and after its promotion they are gone (jetbox then stops with the timeline error)",
			fmt.Sprintf("ALTER SYSTEM SET synchronized_standby_slots = '%s'; SELECT pg_reload_conf()", strings.Join(names, ",")))
		return
	}
	c.l.Add(check.Info, "postgres.synchronized_standby_slots", "synchronized_standby_slots = "+sss+": jetbox receives only changes those standbys have", "")
}

func (c *checker) database() string {
	var d string
	_ = c.conn.QueryRow(c.ctx, "SELECT current_database()").Scan(&d)
	return d
}
