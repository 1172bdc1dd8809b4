"""Pure schedules and the cost model: who sends what to whom, and how long it must take. No I/O."""
