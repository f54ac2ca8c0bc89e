"""Calendar constants shared by every billing mode."""

SECONDS_PER_HOUR = 3600.0
HOURS_PER_DAY = 24.0
SECONDS_PER_DAY = SECONDS_PER_HOUR * HOURS_PER_DAY
# A month is 1/12 of a Julian year, so monthly figures do not depend on which month it is.
DAYS_PER_MONTH = 365.25 / 12.0
TOKENS_PER_MILLION = 1_000_000.0
