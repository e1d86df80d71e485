"""Published hardware figures the advisor and the simulator reason with: interconnects (`links`) and
accelerators (`accelerators`), each number with the source it was taken from."""
