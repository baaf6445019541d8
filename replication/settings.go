package replication

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/rs/zerolog"
)

// Settings whose change a SettingsError refuses.
const (
	SettingRouting = "routing"             // --subject-template, --partitions
	SettingAtomic  = "atomic-transactions" // --atomic-transactions
)

// SettingsError says this run's settings differ from those the stream's
// last message was stored under, in a way that breaks a promise to
// consumers (an aggregate's events on one subject; an atomic transaction
// ended by Jetbox-Tx-Last). jetbox stops on it (exit 2) and confirms
// nothing.
type SettingsError struct {
	Setting string // SettingRouting or SettingAtomic
	Tip     StreamTip
	Err     error
	Hint    string
}

func (e *SettingsError) Error() string { return e.Err.Error() + "; fix: " + e.Hint }

func (e *SettingsError) Unwrap() error { return e.Err }

// Permanent marks the error as one to stop on.
func (e *SettingsError) Permanent() bool { return true }

// routing is a subject template and its partition count.
type routing struct {
	template   string
	partitions int
}

// parseRouting reads the routing part of a Jetbox-Routing value.
func parseRouting(header string) routing {
	t, n, _ := decoder.ParseRouting(header)
	return routing{template: t, partitions: n}
}

// tipRouting returns the routing the tip was stored under; known is false
// for a tip without Jetbox-Routing whose subject is not the default
// template's: a jetbox that did not record its routing stored it.
func tipRouting(tip StreamTip, cfg decoder.Config) (r routing, known bool) {
	if tip.Routing != "" {
		return parseRouting(tip.Routing), true
	}
	def, err := decoder.Subject(cfg.SubjectPrefix, tip.AggregateType, tip.EventType)
	return routing{template: decoder.DefaultSubjectTemplate}, err == nil && def == tip.Subject
}

// ownSubject reports whether the tip is on one of jetbox's own subjects
// (<prefix>._dlq, the repair baseline), which no template routes.
func ownSubject(tip StreamTip, cfg decoder.Config) bool {
	return strings.HasPrefix(tip.Subject, cfg.SubjectPrefix+"._")
}

// checkRouting refuses to route events otherwise than the stream's last
// message was (its Jetbox-Routing): a changed subject template or
// partition count moves an aggregate's events to another subject while
// consumers read the old ones, so a consumer of an aggregate's subject
// misses its later events or processes them out of order with the ones it
// still holds. With allow (--allow-routing-change) it goes on; changed
// reports the change, to log. A tip stored by a jetbox that did not
// record its routing is judged by its subject: refused when this run
// would give its event another one (a message that names no event, such
// as a test's, passes).
func checkRouting(tip StreamTip, cfg decoder.Config, allow bool) (changed bool, err error) {
	cur := parseRouting(cfg.Routing())
	if tip.Routing == "" && ownSubject(tip, cfg) {
		// A dead letter or a repair baseline without Jetbox-Routing: the
		// default routing, or a jetbox that did not record it. Telling it
		// the default could refuse the routing the stream holds, with a
		// hint to change it: nothing to judge by.
		return false, nil
	}
	stored, known := tipRouting(tip, cfg)
	var was, now, back string
	switch {
	case known && stored == cur:
		return false, nil
	case known:
		was, now = routingDiff(stored, cur)
		back = "restart with " + was + " (the stream's routing)"
	default:
		subject, err := cfg.SubjectFor(tip.AggregateType, tip.AggregateID, tip.EventType)
		if err != nil || subject == tip.Subject { // nothing to judge by, or the same subject
			return false, nil
		}
		was, now = "another routing (a jetbox that did not record it in Jetbox-Routing stored it)", describeRouting(cur)+", which gives its event the subject "+subject
		back = "restart with the --subject-template and --partitions that stored it"
	}
	if allow {
		return true, nil
	}
	return true, &SettingsError{Setting: SettingRouting, Tip: tip,
		Err: fmt.Errorf("the stream's last message (seq %d, commit LSN %s, committed at %s, subject %s) was routed under %s, and this run routes under %s: an aggregate's next events would go to another subject than its earlier ones while consumers read the old subjects, breaking per-aggregate order",
			tip.Seq, tip.CommitLSN, tip.CommitTime, tip.Subject, was, now),
		Hint: back + "; or, to change it deliberately, drain the consumers of the old subjects first, then restart once with --allow-routing-change (JETBOX_ALLOW_ROUTING_CHANGE=true): the check is moot once one message under the new routing is stored"}
}

// routingDiff spells the settings in which a and b differ as the flags
// that give them.
func routingDiff(a, b routing) (string, string) {
	var as, bs []string
	if a.template != b.template {
		as, bs = append(as, "--subject-template="+a.template), append(bs, "--subject-template="+b.template)
	}
	if a.partitions != b.partitions {
		as, bs = append(as, "--partitions="+strconv.Itoa(a.partitions)), append(bs, "--partitions="+strconv.Itoa(b.partitions))
	}
	return strings.Join(as, " "), strings.Join(bs, " ")
}

// describeRouting spells a routing as the flags that give it.
func describeRouting(r routing) string {
	return "--subject-template=" + r.template + " --partitions=" + strconv.Itoa(r.partitions)
}

// checkAtomic refuses to switch --atomic-transactions while the slot
// replays the transaction of the stream's last message (committed at or
// after the slot's confirmed position start) and that transaction may be
// unfinished in the stream: an atomic-mode tip without Jetbox-Tx-Last
// (a chunked transaction stored in part) would get its remaining events
// without Jetbox-Tx-Last, so consumers waiting for its end never see it;
// a tip stored without atomic batches would get its rest as an atomic
// batch, after consumers saw its first part.
func checkAtomic(tip StreamTip, atomic bool, start pglogrepl.LSN) error {
	_, _, tipAtomic := decoder.ParseRouting(tip.Routing)
	if tip.CommitLSN < start || tip.TxLast || tipAtomic == atomic {
		return nil
	}
	was, flag := "without atomic batches", "without --atomic-transactions"
	now := "as atomic batches: its rest would be one, after consumers saw its start"
	if tipAtomic {
		was, flag = "as atomic batches (--atomic-transactions) and is not finished there (no Jetbox-Tx-Last on its stored part)", "with --atomic-transactions"
		now = "without atomic batches: its rest would be stored without Jetbox-Tx-Last, and consumers waiting for the end of that transaction would never get it"
	}
	return &SettingsError{Setting: SettingAtomic, Tip: tip,
		Err: fmt.Errorf("the stream's last transaction (commit LSN %s, committed at %s, seq %d) was stored %s, and the slot replays it (confirmed position %s), while this run stores transactions %s",
			tip.CommitLSN, tip.CommitTime, tip.Seq, was, start, now),
		Hint: "restart once " + flag + " until that transaction is confirmed (a clean stop after it), then change --atomic-transactions"}
}

// checkSettings runs checkRouting and checkAtomic for the session's tip
// (of this database and slot) and the slot's confirmed position start.
func checkSettings(tip StreamTip, cfg Config, start pglogrepl.LSN, log zerolog.Logger) error {
	changed, err := checkRouting(tip, cfg.Decoder, cfg.AllowRoutingChange)
	if err != nil {
		return err
	}
	if changed {
		log.Warn().Uint64("tip_seq", tip.Seq).Str("tip_subject", tip.Subject).Str("tip_routing", tip.Routing).Str("routing", cfg.Decoder.Routing()).
			Msg("--allow-routing-change: going on under another subject template or partition count than the stream's last message; drop the flag once a message under the new routing is stored")
	}
	return checkAtomic(tip, cfg.Decoder.Atomic, start)
}
