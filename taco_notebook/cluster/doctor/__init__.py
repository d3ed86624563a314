"""``%taco_doctor``: facts from every node, what is wrong with them and the remedy, the links between them."""
