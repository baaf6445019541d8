package sink

import "testing"

// TestDeliveryModes: what each of the four modes does.
func TestDeliveryModes(t *testing.T) {
	for _, c := range []struct {
		d                                 Delivery
		exactly, atomic, guarded, persist bool
		flag                              string
	}{
		{ExactlyOnce, true, false, true, false, "exactly-once"},
		{ExactlyOnceAtomic, true, true, true, false, "exactly-once"},
		{DedupGuarded, false, false, true, true, "dedup"},
		{Dedup, false, false, false, false, "dedup"},
	} {
		if c.d.ExactlyOnce() != c.exactly || c.d.Atomic() != c.atomic || c.d.Guarded() != c.guarded ||
			c.d.PersistsWatermark() != c.persist || c.d.Flag() != c.flag {
			t.Errorf("%v: exactly-once %v, atomic %v, guarded %v, persists watermark %v, flag %s", c.d,
				c.d.ExactlyOnce(), c.d.Atomic(), c.d.Guarded(), c.d.PersistsWatermark(), c.d.Flag())
		}
	}
	if (Config{}).Delivery != Dedup {
		t.Error("the zero Config is not dedup without the order guard (what it was before Delivery)")
	}
}
