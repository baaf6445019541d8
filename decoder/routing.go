package decoder

import (
	"strconv"
	"strings"
)

// Routing names how c routes events to subjects: "" under
// DefaultSubjectTemplate, else "template=<text>", with " partitions=<N>"
// when the template has {partition}. Changed while consumers run, it moves
// an aggregate's events to another subject (replication checks it against
// the stream's last message).
func (c Config) Routing() string {
	t := c.Subjects
	if t == nil || (t.String() == DefaultSubjectTemplate && t.Partitions() == 0) {
		return ""
	}
	s := "template=" + t.String()
	if n := t.Partitions(); n > 0 {
		s += " partitions=" + strconv.Itoa(n)
	}
	return s
}

// RoutingHeader is the Jetbox-Routing value of c's messages: Routing, and
// the field "atomic" when the sink stores transactions atomically (Atomic).
// "" (no header) under the default routing without atomic batches, so
// those messages do not grow.
func (c Config) RoutingHeader() string {
	r := c.Routing()
	if c.Atomic {
		if r != "" {
			r += " "
		}
		r += "atomic"
	}
	return r
}

// ParseRouting reads a Jetbox-Routing value (see RoutingHeader): the subject
// template (DefaultSubjectTemplate when it names none), the number of
// partitions and whether the message was stored as part of an atomic
// batch. Unknown fields are ignored. A template holds no whitespace, so the
// fields are separated by spaces.
func ParseRouting(v string) (template string, partitions int, atomic bool) {
	template = DefaultSubjectTemplate
	for _, f := range strings.Fields(v) {
		switch k, val, _ := strings.Cut(f, "="); k {
		case "template":
			template = val
		case "partitions":
			partitions, _ = strconv.Atoi(val)
		case "atomic":
			atomic = true
		}
	}
	return template, partitions, atomic
}

// SubjectFor returns the subject c gives an event of that aggregate type,
// aggregate id and event type.
func (c *Config) SubjectFor(aggregateType, aggregateID, eventType string) (string, error) {
	return c.subject(&Event{AggregateType: aggregateType, AggregateID: aggregateID, EventType: eventType})
}
